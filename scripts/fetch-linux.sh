#!/usr/bin/env bash
# Fetch Debian's cloud kernel and unpack the ELF vmlinux hidden inside its bzImage.
#
# Usage: scripts/fetch-linux.sh [CACHE_DIR]
#   CACHE_DIR defaults to ${XDG_CACHE_HOME:-$HOME/.cache}/musubi/linux
#
# Prints two lines:
#   bzimage=PATH   the bzImage as shipped (Linux boot protocol)
#   vmlinux=PATH   the ELF kernel with the Xen PVH entry note (PVH boot)
#
# The ELF is what lets the same kernel be booted through PVH: Debian ships only the
# bzImage, whose protected-mode part carries the real kernel as an LZ4 payload.
# Running it again reuses what is already in CACHE_DIR.
set -euo pipefail

cache_dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/musubi/linux}

die() {
    echo "fetch-linux: $*" >&2
    exit 1
}

# Run as root directly, or through sudo when that exists; apt needs root for installs/updates.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root to run: $*"
    fi
}

# The newest versioned cloud kernel image, by version order of the package name; the
# -dbg and -unsigned variants hold the same kernel (or none) and are skipped.
newest_cloud_package() {
    apt-cache search --names-only '^linux-image-.*-cloud-amd64$' 2>/dev/null |
        awk '{print $1}' |
        grep -E '^linux-image-[0-9][0-9.]*-[0-9]+-cloud-amd64$' |
        sort -V | tail -n 1 || true
}

# Little-endian unsigned integer of WIDTH bytes at OFFSET in FILE.
read_le() {
    local file=$1 offset=$2 width=$3
    od -An -t "u${width}" -j "$offset" -N "$width" --endian=little "$file" | tr -d ' \n'
}

# COUNT bytes at OFFSET in FILE as hex digits.
hex_at() {
    od -An -t x1 -j "$2" -N "$3" "$1" | tr -d ' \n'
}

# COUNT bytes at OFFSET in FILE on stdout. dd reads exactly that much, so no reader in
# the pipeline is cut off early (a SIGPIPE would trip pipefail).
slice() {
    dd if="$1" bs=64K iflag=skip_bytes,count_bytes skip="$2" count="$3" status=none
}

is_elf() {
    [ -f "$1" ] && [ "$(hex_at "$1" 0 4)" = "7f454c46" ]
}

mkdir -p "$cache_dir"
cache_dir=$(cd "$cache_dir" && pwd)
bzimage="$cache_dir/vmlinuz"
vmlinux="$cache_dir/vmlinux"

if [ ! -s "$bzimage" ]; then
    pkg=$(newest_cloud_package)
    if [ -z "$pkg" ]; then
        echo "fetch-linux: no cloud kernel in the apt cache; running apt-get update" >&2
        as_root apt-get update -qq >&2
        pkg=$(newest_cloud_package)
    fi
    [ -n "$pkg" ] || die "apt-cache finds no linux-image-*-cloud-amd64 package (is this Debian?)"
    echo "fetch-linux: downloading $pkg" >&2

    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    # apt-get download writes into the current directory; _apt may not be able to write
    # to a root-owned mktemp dir, so let it.
    chmod 0777 "$work"
    (cd "$work" && apt-get download -q "$pkg" >&2)
    debs=("$work"/*.deb)
    deb=${debs[0]}
    [ -f "$deb" ] || die "apt-get download $pkg produced no .deb"
    dpkg-deb -x "$deb" "$work/root"
    images=("$work"/root/boot/vmlinuz-*)
    image=${images[0]}
    [ -f "$image" ] || die "$deb has no boot/vmlinuz-*"
    cp "$image" "$bzimage.tmp"
    # Remember which kernel this is: the file name carries the release string.
    basename "$image" | sed 's/^vmlinuz-//' >"$cache_dir/release"
    mv "$bzimage.tmp" "$bzimage"
fi

if ! is_elf "$vmlinux"; then
    if ! command -v lz4 >/dev/null 2>&1; then
        echo "fetch-linux: installing lz4" >&2
        as_root apt-get install -y -qq lz4 >&2 ||
            { as_root apt-get update -qq >&2 && as_root apt-get install -y -qq lz4 >&2; }
    fi

    # Boot protocol setup header fields (Documentation/arch/x86/boot.rst).
    [ "$(slice "$bzimage" $((0x202)) 4)" = "HdrS" ] ||
        die "$bzimage has no 'HdrS' setup header: not a bzImage"
    setup_sects=$(read_le "$bzimage" $((0x1f1)) 1)
    [ "$setup_sects" -ne 0 ] || setup_sects=4
    payload_offset=$(read_le "$bzimage" $((0x248)) 4)
    payload_length=$(read_le "$bzimage" $((0x24c)) 4)
    start=$(((setup_sects + 1) * 512 + payload_offset))
    [ "$payload_length" -gt 0 ] || die "$bzimage has an empty compressed payload"

    magic=$(hex_at "$bzimage" "$start" 4)
    # 02 21 4c 18 is the LZ4 legacy frame magic, the format the kernel's lz4 stub reads.
    [ "$magic" = "02214c18" ] ||
        die "payload of $bzimage at offset $start starts with $magic, not the LZ4 legacy magic 02214c18 (other compressors are not handled)"

    # lz4 exits 1 on the 4-byte uncompressed-size word the kernel build appends after the
    # last frame, yet everything before it is decoded: judge the output, not the status.
    slice "$bzimage" "$start" "$payload_length" |
        lz4 -d -c >"$vmlinux.tmp" 2>/dev/null || true
    is_elf "$vmlinux.tmp" || {
        rm -f "$vmlinux.tmp"
        die "lz4 -d of the payload of $bzimage did not produce an ELF file"
    }
    mv "$vmlinux.tmp" "$vmlinux"
fi

echo "bzimage=$bzimage"
echo "vmlinux=$vmlinux"
