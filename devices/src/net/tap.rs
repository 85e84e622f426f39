//! A TAP interface carrying whole Ethernet frames, each behind a 12-byte virtio-net header.
//!
//! The header size is fixed at that of `virtio_net_hdr_v1` (with `num_buffers`), the only
//! layout a VERSION_1 driver uses, so frames pass between the TAP and guest buffers without
//! re-framing, and checksum and segmentation offload requests travel with them.
//! The descriptor is non-blocking: the device is driven from an event loop and must never
//! sleep in a read or write.
//!
//! A TAP opened for several queue pairs has `IFF_MULTI_QUEUE` and one descriptor per
//! queue; the kernel spreads the frames it sends over the queues attached, and a queue the
//! guest does not use is detached so no frame waits there unread.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_ref, ioctl_with_val};

/// Bytes of `virtio_net_hdr_v1` in front of every frame.
pub const VNET_HDR_LEN: usize = 12;

const TUN_PATH: &str = "/dev/net/tun";
const TAP_FLAGS: libc::c_int = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;

/// Why a TAP could not be used. Every message names the interface (or, for a handed-over
/// descriptor whose name is not known yet, the descriptor) and the step that failed, since a
/// VM may have several and the fix (permissions, a missing module, a busy name) depends on
/// which step it was.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("TAP {name}: {why}")]
    BadName { name: String, why: &'static str },
    #[error("TAP {name}: {op}: {source}")]
    Os {
        name: String,
        op: &'static str,
        source: io::Error,
    },
    #[error("TAP {name}: {queues} queues asked for; a TAP has 1 to {MAX_TAP_QUEUES}")]
    Queues { name: String, queues: usize },
    #[error(
        "TAP {name}: the descriptor is not a TAP with virtio-net headers (flags {flags:#x}; \
         it needs IFF_TAP, IFF_NO_PI and IFF_VNET_HDR)"
    )]
    NotVnetTap { name: String, flags: i32 },
}

/// Queues a multiqueue TAP may have (Linux's `MAX_TAP_QUEUES`).
pub const MAX_TAP_QUEUES: usize = 256;

/// An open TAP queue.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
    /// Opened with `IFF_MULTI_QUEUE`, so the queue can be detached and attached again.
    multi_queue: bool,
}

/// An `ifreq` naming `name`, everything else zero.
fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain old data (a name array and a union of integers, sockaddrs and a
    // pointer), for which all-zero bytes are a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    ifr
}

fn ifreq_name(ifr: &libc::ifreq) -> String {
    let bytes: Vec<u8> = ifr
        .ifr_name
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn check_name(name: &str) -> Result<(), TapError> {
    let why = if name.is_empty() {
        "empty interface name"
    } else if name.len() >= libc::IFNAMSIZ {
        "interface name longer than 15 bytes"
    } else if name
        .bytes()
        .any(|b| b == b'/' || b == 0 || b.is_ascii_whitespace() || b == b':')
    {
        "interface names may not contain '/', ':', NUL or white space"
    } else {
        return Ok(());
    };
    Err(TapError::BadName {
        name: name.to_string(),
        why,
    })
}

impl Tap {
    /// Opens TAP `name`, creating it if no interface has that name. Creating one needs
    /// CAP_NET_ADMIN; opening one the caller owns does not.
    pub fn open_or_create(name: &str) -> Result<Tap, TapError> {
        Tap::open_queue(name, TAP_FLAGS)
    }

    /// Opens `queues` queues of TAP `name`, creating it if no interface has that name: one
    /// queue is [`Tap::open_or_create`] exactly; more are a TAP with `IFF_MULTI_QUEUE`,
    /// which an existing single-queue TAP of that name is not (the kernel refuses it).
    pub fn open_queues(name: &str, queues: usize) -> Result<Vec<Tap>, TapError> {
        if queues == 0 || queues > MAX_TAP_QUEUES {
            return Err(TapError::Queues {
                name: name.to_string(),
                queues,
            });
        }
        if queues == 1 {
            return Ok(vec![Tap::open_or_create(name)?]);
        }
        let flags = TAP_FLAGS | libc::IFF_MULTI_QUEUE;
        let first = Tap::open_queue(name, flags)?;
        // A template name (`tap%d`) was resolved by the first open; the others join it.
        let resolved = first.name.clone();
        let mut taps = vec![first];
        for _ in 1..queues {
            taps.push(Tap::open_queue(&resolved, flags)?);
        }
        Ok(taps)
    }

    fn open_queue(name: &str, flags: libc::c_int) -> Result<Tap, TapError> {
        check_name(name)?;
        let os = |op| {
            let name = name.to_string();
            move |source| TapError::Os { name, op, source }
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(TUN_PATH)
            .map_err(os("opening /dev/net/tun"))?;
        let mut ifr = ifreq(name);
        ifr.ifr_ifru.ifru_flags = flags as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes one ifreq, which `ifr` is and outlives the call.
        let r = unsafe { ioctl_with_mut_ref(&file, libc::TUNSETIFF as _, &mut ifr) };
        if r < 0 {
            let op = if flags & libc::IFF_MULTI_QUEUE != 0 {
                "TUNSETIFF with IFF_MULTI_QUEUE"
            } else {
                "TUNSETIFF"
            };
            return Err(os(op)(io::Error::last_os_error()));
        }
        let tap = Tap {
            file,
            name: ifreq_name(&ifr),
            multi_queue: flags & libc::IFF_MULTI_QUEUE != 0,
        };
        tap.set_vnet_hdr_size()?;
        Ok(tap)
    }

    /// Adopts a TAP descriptor an orchestrator opened (and may have made before dropping its
    /// privileges). It is checked to really be a TAP with virtio-net headers, since a TUN or a
    /// TAP without them would corrupt every frame silently.
    pub fn from_fd(fd: OwnedFd) -> Result<Tap, TapError> {
        let label = format!("fd {}", fd.as_raw_fd());
        let file = File::from(fd);
        let mut ifr = ifreq("");
        // SAFETY: TUNGETIFF writes one ifreq, which `ifr` is and outlives the call.
        let r = unsafe { ioctl_with_mut_ref(&file, libc::TUNGETIFF as _, &mut ifr) };
        if r < 0 {
            return Err(TapError::Os {
                name: label,
                op: "TUNGETIFF",
                source: io::Error::last_os_error(),
            });
        }
        let name = ifreq_name(&ifr);
        // SAFETY: TUNGETIFF filled the flags member of the union.
        let flags = i32::from(unsafe { ifr.ifr_ifru.ifru_flags }) & 0xffff;
        if flags & TAP_FLAGS != TAP_FLAGS || flags & libc::IFF_TUN != 0 {
            return Err(TapError::NotVnetTap { name, flags });
        }
        let tap = Tap {
            file,
            name,
            multi_queue: flags & libc::IFF_MULTI_QUEUE != 0,
        };
        tap.set_nonblocking()?;
        tap.set_vnet_hdr_size()?;
        Ok(tap)
    }

    /// Whether this is a queue of a TAP made with `IFF_MULTI_QUEUE`.
    pub fn is_multi_queue(&self) -> bool {
        self.multi_queue
    }

    /// The interface name as the kernel reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn os_error(&self, op: &'static str) -> TapError {
        TapError::Os {
            name: self.name.clone(),
            op,
            source: io::Error::last_os_error(),
        }
    }

    fn set_vnet_hdr_size(&self) -> Result<(), TapError> {
        let size = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int, which `size` is and outlives the call.
        let r = unsafe { ioctl_with_ref(&self.file, libc::TUNSETVNETHDRSZ as _, &size) };
        if r < 0 {
            return Err(self.os_error("TUNSETVNETHDRSZ"));
        }
        Ok(())
    }

    fn set_nonblocking(&self) -> Result<(), TapError> {
        super::set_nonblocking(self.file.as_raw_fd()).map_err(|source| TapError::Os {
            name: self.name.clone(),
            op: "setting O_NONBLOCK",
            source,
        })
    }

    /// Tells the kernel which offloads the reader (the guest) handles, as `TUN_F_*` bits:
    /// frames it sends us may then carry partial checksums or be larger than the MTU.
    pub fn set_offload(&self, flags: u32) -> Result<(), TapError> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value and touches no memory of ours.
        let r = unsafe { ioctl_with_val(&self.file, libc::TUNSETOFFLOAD as _, flags.into()) };
        if r < 0 {
            return Err(self.os_error("TUNSETOFFLOAD"));
        }
        Ok(())
    }

    /// Attaches the queue to its interface or detaches it (`TUNSETQUEUE`), so the kernel
    /// sends frames only to queues someone reads. A single-queue TAP has nothing to detach
    /// and ignores it.
    pub fn set_queue_enabled(&self, on: bool) -> Result<(), TapError> {
        if !self.multi_queue {
            return Ok(());
        }
        let mut ifr = ifreq("");
        let flags = if on {
            libc::IFF_ATTACH_QUEUE
        } else {
            libc::IFF_DETACH_QUEUE
        };
        ifr.ifr_ifru.ifru_flags = flags as libc::c_short;
        // SAFETY: TUNSETQUEUE reads one ifreq, which `ifr` is and outlives the call.
        let r = unsafe { ioctl_with_mut_ref(&self.file, libc::TUNSETQUEUE as _, &mut ifr) };
        if r < 0 {
            return Err(self.os_error(if on {
                "TUNSETQUEUE attaching the queue"
            } else {
                "TUNSETQUEUE detaching the queue"
            }));
        }
        Ok(())
    }

    /// Gives the interface an IPv4 address and netmask and brings the link up, for setups
    /// where the host end is routed rather than bridged.
    pub fn set_up_with_address(&self, ip: Ipv4Addr, mask: Ipv4Addr) -> Result<(), TapError> {
        // SAFETY: socket() takes no pointers; the result is checked before use.
        let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(self.os_error("opening an AF_INET socket"));
        }
        // SAFETY: `raw` is a descriptor socket() just returned, owned by nobody else.
        let sock = unsafe { OwnedFd::from_raw_fd(raw) };
        let ioctl = |req: libc::c_ulong, op: &'static str, ifr: &mut libc::ifreq| {
            // SAFETY: every request used here reads or writes exactly one ifreq.
            let r = unsafe { ioctl_with_mut_ref(&sock, req as _, ifr) };
            if r < 0 {
                Err(self.os_error(op))
            } else {
                Ok(())
            }
        };
        for (req, op, addr) in [
            (libc::SIOCSIFADDR, "SIOCSIFADDR", ip),
            (libc::SIOCSIFNETMASK, "SIOCSIFNETMASK", mask),
        ] {
            let mut ifr = ifreq(&self.name);
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: 0,
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(addr.octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in is no larger than the sockaddr member it is written over,
            // and both are plain old data.
            unsafe {
                std::ptr::write_unaligned(
                    std::ptr::addr_of_mut!(ifr.ifr_ifru.ifru_addr).cast::<libc::sockaddr_in>(),
                    sin,
                );
            }
            ioctl(req, op, &mut ifr)?;
        }
        let mut ifr = ifreq(&self.name);
        ioctl(libc::SIOCGIFFLAGS, "SIOCGIFFLAGS", &mut ifr)?;
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        let flags = unsafe { ifr.ifr_ifru.ifru_flags };
        ifr.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        ioctl(libc::SIOCSIFFLAGS, "SIOCSIFFLAGS", &mut ifr)
    }

    /// Reads one frame (header included); `WouldBlock` when none is queued.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    /// Writes one frame (header included) given in pieces; the kernel takes it whole or not
    /// at all.
    pub fn write_vectored(&self, iovs: &[IoSlice<'_>]) -> io::Result<usize> {
        (&self.file).write_vectored(iovs)
    }

    pub fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// `TUN_F_*` bits for `set_offload` from the virtio-net features the driver accepted: what the
/// guest can take on receive (partial checksums, TSO and UFO frames).
pub fn offload_flags(acked_features: u64) -> u32 {
    use virtio_bindings::virtio_net::*;
    let has = |bit: u32| acked_features & (1u64 << bit) != 0;
    let mut flags = 0;
    if has(VIRTIO_NET_F_GUEST_CSUM) {
        flags |= libc::TUN_F_CSUM;
        if has(VIRTIO_NET_F_GUEST_TSO4) {
            flags |= libc::TUN_F_TSO4;
        }
        if has(VIRTIO_NET_F_GUEST_TSO6) {
            flags |= libc::TUN_F_TSO6;
        }
        if has(VIRTIO_NET_F_GUEST_UFO) {
            flags |= libc::TUN_F_UFO;
        }
    }
    flags
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_net::*;

    #[test]
    fn bad_names_are_refused_naming_them() {
        for (name, part) in [
            ("", "empty"),
            ("a-name-far-too-long", "longer than 15"),
            ("tap/0", "may not contain"),
            ("tap 0", "may not contain"),
        ] {
            let e = Tap::open_or_create(name).unwrap_err().to_string();
            assert!(e.starts_with(&format!("TAP {name}: ")), "{e}");
            assert!(e.contains(part), "{e}");
        }
    }

    #[test]
    fn a_descriptor_that_is_no_tap_is_refused_naming_it() {
        let (a, _b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let fd = OwnedFd::from(a);
        let raw = fd.as_raw_fd();
        let e = Tap::from_fd(fd).unwrap_err().to_string();
        assert!(e.starts_with(&format!("TAP fd {raw}: TUNGETIFF: ")), "{e}");
    }

    #[test]
    fn offloads_follow_the_guests_receive_features() {
        let f = |bits: &[u32]| bits.iter().fold(0u64, |acc, b| acc | 1 << b);
        assert_eq!(offload_flags(0), 0);
        // TSO without checksum offload is meaningless and not passed on.
        assert_eq!(offload_flags(f(&[VIRTIO_NET_F_GUEST_TSO4])), 0);
        assert_eq!(
            offload_flags(f(&[
                VIRTIO_NET_F_GUEST_CSUM,
                VIRTIO_NET_F_GUEST_TSO4,
                VIRTIO_NET_F_GUEST_TSO6,
                VIRTIO_NET_F_HOST_TSO4,
            ])),
            libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6
        );
    }

    /// Set by the parent test for the copy of the test binary it runs in a fresh network
    /// namespace, so the real-TAP test can never run in the host's own namespace.
    const NETNS_CHILD: &str = "MUSUBI_TAP_TEST_IN_NETNS";

    /// A real TAP, created in a network namespace of its own by a child process: needs root
    /// (or CAP_NET_ADMIN and user namespaces); skipped with a note where that is missing.
    #[test]
    fn real_tap_in_a_private_network_namespace() {
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new("unshare")
            .arg("--net")
            .arg(&exe)
            .args([
                "--exact",
                "net::tap::tests::real_tap_child",
                "--include-ignored",
                "--nocapture",
            ])
            .env(NETNS_CHILD, "1")
            .output();
        let out = out.unwrap_or_else(|e| {
            panic!("this test needs util-linux's `unshare` to make a network namespace: {e}")
        });
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            !text.contains("unshare failed"),
            "this test makes a network namespace, which needs root (CAP_SYS_ADMIN): {text}"
        );
        assert!(out.status.success(), "child failed: {text}");
        assert!(
            text.contains("1 passed"),
            "child did not run the test: {text}"
        );
    }

    #[test]
    #[ignore = "run by real_tap_in_a_private_network_namespace inside a new namespace"]
    fn real_tap_child() {
        assert_eq!(
            std::env::var(NETNS_CHILD).as_deref(),
            Ok("1"),
            "only runs in the namespace its parent test made"
        );
        let tap = Tap::open_or_create("mtap%d").unwrap();
        assert!(tap.name().starts_with("mtap"), "{}", tap.name());
        tap.set_offload(libc::TUN_F_CSUM | libc::TUN_F_TSO4)
            .unwrap();
        tap.set_up_with_address(Ipv4Addr::new(10, 9, 8, 1), Ipv4Addr::new(255, 255, 255, 0))
            .unwrap();
        // Opening the same name again attaches to the existing interface.
        let e = Tap::open_or_create(tap.name()).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("TAP {}: TUNSETIFF: ", tap.name())),
            "a single-queue TAP has one reader: {e}"
        );
        // A handed-over descriptor is recognised with its name.
        let dup = tap.file.try_clone().unwrap();
        let adopted = Tap::from_fd(OwnedFd::from(dup)).unwrap();
        assert_eq!(adopted.name(), tap.name());
        let mut buf = [0u8; 2048];
        let e = tap.read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        // A frame written with a header is taken whole.
        let mut frame = vec![0u8; VNET_HDR_LEN];
        frame.extend_from_slice(&[0xff; 6]);
        frame.extend_from_slice(&[0x52, 0x54, 0, 1, 2, 3]);
        frame.extend_from_slice(&[0x88, 0xb5]);
        frame.extend_from_slice(&[0u8; 46]);
        let n = tap.write_vectored(&[IoSlice::new(&frame)]).unwrap();
        assert_eq!(n, frame.len());
        // A single-queue TAP is not opened again as a multiqueue one.
        let e = Tap::open_queues(tap.name(), 2).unwrap_err().to_string();
        assert!(e.contains("TUNSETIFF with IFF_MULTI_QUEUE"), "{e}");
        // Several queues of one interface, each a descriptor of its own, which can be
        // detached and attached again; a detached queue takes no frames.
        let queues = Tap::open_queues("mq%d", 3).unwrap();
        assert_eq!(queues.len(), 3);
        let name = queues[0].name().to_string();
        assert!(name.starts_with("mq"), "{name}");
        assert!(queues.iter().all(|q| q.name() == name));
        queues[0]
            .set_up_with_address(Ipv4Addr::new(10, 9, 7, 1), Ipv4Addr::new(255, 255, 255, 0))
            .unwrap();
        // Detached queues get none of the frames the host sends (here the ARP request a
        // datagram to a neighbour brings), and still take frames to send.
        for q in &queues[1..] {
            q.set_queue_enabled(false).unwrap();
        }
        let udp = std::net::UdpSocket::bind("10.9.7.1:0").unwrap();
        udp.send_to(b"hello", "10.9.7.2:9").unwrap();
        let mut got = None;
        for _ in 0..200 {
            match queues[0].read(&mut buf) {
                Ok(n) => {
                    got = Some(n);
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(got.is_some(), "no frame on the attached queue");
        for q in &queues[1..] {
            let e = q.read(&mut buf).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        }
        queues[1].write_vectored(&[IoSlice::new(&frame)]).unwrap();
        queues[1].set_queue_enabled(true).unwrap();
        queues[1].write_vectored(&[IoSlice::new(&frame)]).unwrap();
        let adopted = Tap::from_fd(OwnedFd::from(queues[2].file.try_clone().unwrap())).unwrap();
        assert_eq!(adopted.name(), name);
        for bad in [0, MAX_TAP_QUEUES + 1] {
            let e = Tap::open_queues("mq%d", bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad} queues asked for")), "{e}");
        }
    }
}
