//! Sets an interface's offloads with `ethtool`'s ioctl, so tests need not the program.

/// `ethtool`'s legacy set commands (`linux/ethtool.h`), which the kernel still takes.
const SIOCETHTOOL: libc::c_ulong = 0x8946;
pub const SRXCSUM: u32 = 0x15;
pub const STXCSUM: u32 = 0x17;
pub const STSO: u32 = 0x1f;

/// `struct ethtool_value`.
#[repr(C)]
struct EthtoolValue {
    cmd: u32,
    data: u32,
}

/// `struct ifreq` with `ifr_data` set, padded to the kernel's 40 bytes.
#[repr(C)]
struct IfreqData {
    name: [u8; libc::IFNAMSIZ],
    data: *mut EthtoolValue,
    _pad: [u8; 16],
}

/// Sets one of interface `dev`'s offloads (in the calling thread's namespace).
pub fn set(dev: &str, cmd: u32, on: u32) -> std::io::Result<()> {
    let mut value = EthtoolValue { cmd, data: on };
    let mut req = IfreqData {
        name: [0; libc::IFNAMSIZ],
        data: &mut value,
        _pad: [0; 16],
    };
    if dev.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::other(format!("{dev}: name too long")));
    }
    req.name[..dev.len()].copy_from_slice(dev.as_bytes());
    // SAFETY: socket(2) has no preconditions; the descriptor is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: SIOCETHTOOL reads an ifreq whose data points at an ethtool_value; both live
    // on this stack frame for the call.
    let r = unsafe { libc::ioctl(fd, SIOCETHTOOL as _, &mut req) };
    let err = std::io::Error::last_os_error();
    // SAFETY: `fd` is the socket opened above, closed once.
    unsafe { libc::close(fd) };
    if r < 0 {
        return Err(std::io::Error::other(format!(
            "ethtool {cmd:#x} on {dev}: {err}"
        )));
    }
    Ok(())
}
