//! Network namespaces a test makes for itself: traffic of network tests goes only to
//! addresses inside them, and nothing is added to the host's own namespace. Dropping one
//! (also while a test panics) deletes it, and with it every interface inside.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};

/// Runs `ip ARGS`, panicking with what it printed when it fails.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run iproute2's `ip` ({e}): the network tests need it (Debian: iproute2)")
        });
    assert!(
        out.status.success(),
        "`ip {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
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
        ip(&["-V"]);
        let ns = Netns {
            name: format!("musubi-t{}-{tag}", std::process::id()),
        };
        // Owned before it exists: a failure below still deletes what was made.
        ip(&["netns", "add", &ns.name]);
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// `program` run inside the namespace (`ip netns exec` execs it: the child's pid is the
    /// program's).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }

    /// `musubi` run inside the namespace.
    pub fn musubi(&self) -> Command {
        self.command(env!("CARGO_BIN_EXE_musubi"))
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

    /// Whether the namespace has an interface named `name`.
    pub fn has_link(&self, name: &str) -> bool {
        Command::new("ip")
            .args(["-n", &self.name, "link", "show", name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.name])
            .stderr(Stdio::null())
            .status();
    }
}
