//! Network namespaces a test makes for itself: traffic of network tests goes only to
//! addresses inside them, and nothing is added to the host's own namespace. Dropping one
//! (also while a test panics) deletes it, and with it every interface inside. iproute2's
//! `ip` does the work, as a program.

use crate::ethtool;
use std::ffi::{c_char, CString};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicPtr, Ordering};

/// Why an `ip` command did not do its work; names the command.
#[derive(Debug, thiserror::Error)]
pub enum IpError {
    #[error("making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); running as euid {euid}")]
    NotRoot { euid: u32 },
    #[error("cannot run iproute2's `ip` for `{command}` ({source}); install it (Debian: apt-get install iproute2)")]
    Run {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {said}")]
    Failed {
        command: String,
        status: ExitStatus,
        /// What it printed on stderr, trimmed.
        said: String,
    },
}

/// Runs `ip ARGS` and returns what it printed on stdout.
pub fn try_ip(args: &[&str]) -> Result<String, IpError> {
    let command = format!("ip {}", args.join(" "));
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| IpError::Run {
            command: command.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(IpError::Failed {
            command,
            status: out.status,
            said: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// [`try_ip`], failing the test when it fails.
pub fn ip(args: &[&str]) -> String {
    try_ip(args).unwrap_or_else(|e| panic!("{e}"))
}

/// One namespace, loopback up.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// `musubi-t<pid>-<tag>`; needs root, and says so when it is missing.
    pub fn new(tag: &str) -> Netns {
        // SAFETY: geteuid(2) has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(
            euid, 0,
            "this test makes network namespaces, which needs root (euid {euid})"
        );
        Netns::try_new(tag).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Netns::new`] for a program that goes on without it (a benchmark's rows that need
    /// it are then reported unavailable, with this error as the reason).
    pub fn try_new(tag: &str) -> Result<Netns, IpError> {
        // SAFETY: geteuid(2) has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if euid != 0 {
            return Err(IpError::NotRoot { euid });
        }
        try_ip(&["-V"])?;
        let name = format!("musubi-t{}-{tag}", std::process::id());
        try_ip(&["netns", "add", &name])?;
        // Owned from here: a failure below still deletes what was made.
        let ns = Netns { name };
        try_ip(&["-n", &ns.name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// `program` run inside the namespace (`ip netns exec` execs it: the child's pid is the
    /// program's).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }

    /// Runs `f` on a thread of its own that has entered the namespace, so the sockets it
    /// opens are the namespace's; the test's other threads stay in the host's.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/run/netns/{}", self.name);
        let file = File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        std::thread::spawn(move || {
            // SAFETY: setns(2) on a descriptor this thread holds open; it moves only the
            // calling thread into the namespace.
            let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
    }

    /// Has SIGINT, SIGTERM and SIGHUP delete the namespace too, before they end the program
    /// as they would have: a program they end runs no destructors (a benchmark that
    /// `bench all`'s time limit or Ctrl-C ends). A few namespaces at a time; past that it
    /// says so and they are left to [`Drop`].
    pub fn delete_on_signal(&self) -> Result<(), String> {
        let path = CString::new(format!("/run/netns/{}", self.name))
            .map_err(|e| format!("namespace {}: {e}", self.name))?;
        let raw = path.into_raw();
        let stored = ON_SIGNAL.iter().any(|s| {
            s.compare_exchange(
                std::ptr::null_mut(),
                raw,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
        });
        if !stored {
            // SAFETY: `raw` came from `into_raw` above and was stored nowhere.
            drop(unsafe { CString::from_raw(raw) });
            return Err(format!(
                "namespace {}: more than {} namespaces to delete on a signal",
                self.name,
                ON_SIGNAL.len()
            ));
        }
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: `on_signal` makes only async-signal-safe calls.
            unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
        }
        Ok(())
    }

    /// Whether the namespace has an interface named `name`.
    pub fn has_link(&self, name: &str) -> bool {
        try_ip(&["-n", &self.name, "link", "show", name]).is_ok()
    }

    /// Turns checksum offload off on interface `dev`, both ways, and with it segmentation
    /// offload: a large TCP frame that leaves through it is then cut into segments and each
    /// checksummed by the kernel in software, and one that arrives is checked. (`ethtool
    /// -K dev tx off rx off`, without the program.)
    pub fn checksum_in_software(&self, dev: &str) -> std::io::Result<()> {
        let dev = dev.to_string();
        self.spawn(move || {
            for cmd in [ethtool::STXCSUM, ethtool::SRXCSUM, ethtool::STSO] {
                ethtool::set(&dev, cmd, 0)?;
            }
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the ethtool thread panicked")))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let path = format!("/run/netns/{}", self.name);
        for slot in &ON_SIGNAL {
            let p = slot.load(Ordering::SeqCst);
            if p.is_null() {
                continue;
            }
            // SAFETY: a non-null slot holds a NUL-terminated string leaked by
            // `delete_on_signal`, freed only by whoever swaps it out.
            let ours = unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes() == path.as_bytes();
            if ours
                && slot
                    .compare_exchange(p, std::ptr::null_mut(), Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                // SAFETY: swapped out of its slot, so no one else frees or reads it (a
                // signal handler that already took it never returns).
                drop(unsafe { CString::from_raw(p) });
            }
        }
        let _ = try_ip(&["netns", "delete", &self.name]);
    }
}

/// The files under /run/netns of the namespaces [`Netns::delete_on_signal`] registered,
/// while they exist.
static ON_SIGNAL: [AtomicPtr<c_char>; 8] = [const { AtomicPtr::new(std::ptr::null_mut()) }; 8];

/// Deletes every registered namespace as `ip netns delete` does (detaches its mount,
/// removes the file), then lets the signal end the program as it would have.
extern "C" fn on_signal(sig: libc::c_int) {
    for slot in &ON_SIGNAL {
        let p = slot.swap(std::ptr::null_mut(), Ordering::SeqCst);
        // SAFETY: `p` is null or a NUL-terminated path leaked by `delete_on_signal`;
        // umount2 and unlink are async-signal-safe.
        unsafe {
            if !p.is_null() {
                libc::umount2(p, libc::MNT_DETACH);
                libc::unlink(p);
            }
        }
    }
    // SAFETY: signal and raise are async-signal-safe.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_registered_for_signals_is_forgotten_when_dropped() {
        let registered = |name: &str| {
            let path = format!("/run/netns/{name}");
            ON_SIGNAL.iter().any(|s| {
                let p = s.load(Ordering::SeqCst);
                // SAFETY: a non-null slot holds a string leaked by `delete_on_signal`.
                !p.is_null() && unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes() == path.as_bytes()
            })
        };
        // Never made: its drop's `ip netns delete` fails, and is ignored.
        let name = format!("musubi-t{}-never-made", std::process::id());
        let ns = Netns { name: name.clone() };
        ns.delete_on_signal().unwrap();
        assert!(registered(&name));
        drop(ns);
        assert!(!registered(&name));
    }

    #[test]
    fn a_failing_ip_command_is_named_with_what_it_printed() {
        let e = try_ip(&["link", "show", "dev", "no-such-device-here"]).unwrap_err();
        let shown = e.to_string();
        assert!(
            shown.contains("`ip link show dev no-such-device-here`"),
            "{shown}"
        );
        let IpError::Failed { said, .. } = &e else {
            panic!("`ip` did not run: {shown}")
        };
        assert!(!said.is_empty(), "{shown}");
    }
}
