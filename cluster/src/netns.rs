//! The private network of one `musubi run --nodes N --netns`: a network namespace per node,
//! all joined by veth links to a Linux bridge in a hub namespace of their own, so node
//! traffic crosses a real network stack (veth, bridge, IPv4 routing) instead of loopback.
//!
//! Everything is made inside namespaces this run creates: the bridge and the hub ends of the
//! veth pairs live in the hub namespace, the other ends in the node namespaces, so nothing
//! appears in the host's own namespace and the addresses (a private /24) can collide with
//! nothing. Deleting the namespaces deletes the rest with them: the kernel destroys a
//! namespace's devices with it, and a veth pair goes with either end. Names carry this
//! process's id, so runs side by side do not meet.
//!
//! iproute2's `ip` does the work, as a program: its failures come back as errors naming the
//! command and what it printed.

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

/// Where `ip netns add` keeps its namespaces (iproute2's NETNS_RUN_DIR).
const NETNS_DIR: &str = "/run/netns";
/// The node addresses: 10.211.0.K+1/24. Any private range would do, since only the run's own
/// namespaces see it.
const SUBNET: [u8; 3] = [10, 211, 0];
const PREFIX_LEN: u8 = 24;
/// The most nodes one /24 with the hub unaddressed holds.
pub const MAX_NETNS_NODES: u16 = 253;
/// Capability bits (linux/capability.h): creating and entering namespaces needs
/// CAP_SYS_ADMIN, configuring their links CAP_NET_ADMIN.
const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;

/// Why the node network could not be made (or a namespace of it removed); names `--netns`
/// and, for `ip`, the command and what it printed.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("--netns with --nodes {0}: the node network holds 1 to {MAX_NETNS_NODES} nodes")]
    NodeCount(u16),
    #[error("--netns: stopped by signal {0} while setting up the node network")]
    Stopped(i32),
    #[error("--netns: cannot open {path} to enter it: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "--netns drives iproute2's `ip` program, which is not on PATH (Debian: apt-get \
         install iproute2)"
    )]
    NoIp,
    #[error("--netns: cannot run {command}: {source}")]
    RunIp {
        command: String,
        source: std::io::Error,
    },
    #[error(
        "--netns: {command} failed ({status}): {}",
        if said.is_empty() { "it printed nothing" } else { said }
    )]
    IpFailed {
        command: String,
        status: std::process::ExitStatus,
        /// What `ip` printed on stderr, trimmed.
        said: String,
    },
    #[error("--netns: cannot read /proc/self/status for capabilities: {0}")]
    Status(#[source] std::io::Error),
    #[error(
        "--netns creates network namespaces and needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); \
         this process lacks {}: run it as root, or leave out --netns to link the nodes over \
         loopback",
        missing.join(" and ")
    )]
    Privileges { missing: Vec<&'static str> },
}

/// The namespaces, bridge and veth links of one run; removed when dropped.
pub struct Netns {
    /// In every interface name (at most 15 bytes: `mb` and the process id leave room).
    tag: String,
    /// Every namespace name starts with it.
    prefix: String,
    hub: String,
    /// Namespaces made so far, in order of creation (the hub first).
    created: Vec<String>,
    /// Each node's namespace, held open so the node process can enter it.
    nodes: Vec<File>,
}

impl Netns {
    /// Creates the network for `n` nodes. `interrupted` is asked between steps, so a stop
    /// signal during set-up ends it there. On any error, what was made so far has been
    /// removed again by the time the error is returned.
    pub fn create(
        n: u16,
        interrupted: &mut dyn FnMut() -> Option<i32>,
    ) -> Result<Netns, NetnsError> {
        if n == 0 || n > MAX_NETNS_NODES {
            return Err(NetnsError::NodeCount(n));
        }
        check_privileges()?;
        let pid = std::process::id();
        let prefix = format!("musubi-{pid}-");
        let mut net = Netns {
            hub: format!("{prefix}hub"),
            tag: format!("mb{pid}"),
            prefix,
            created: Vec::new(),
            nodes: Vec::new(),
        };
        net.build(n, interrupted)?;
        Ok(net)
    }

    fn build(
        &mut self,
        n: u16,
        interrupted: &mut dyn FnMut() -> Option<i32>,
    ) -> Result<(), NetnsError> {
        let stop = |interrupted: &mut dyn FnMut() -> Option<i32>| match interrupted() {
            Some(sig) => Err(NetnsError::Stopped(sig)),
            None => Ok(()),
        };
        let hub = self.hub.clone();
        let bridge = format!("{}br", self.tag);
        self.add_namespace(&hub)?;
        ip(&["-n", &hub, "link", "add", &bridge, "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", &bridge, "up"])?;
        for k in 0..n {
            stop(interrupted)?;
            let ns = self.node_namespace(k);
            let (hub_end, node_end) = (format!("{}h{k}", self.tag), format!("{}n{k}", self.tag));
            self.add_namespace(&ns)?;
            ip(&[
                "-n", &hub, "link", "add", &hub_end, "type", "veth", "peer", "name", &node_end,
                "netns", &ns,
            ])?;
            ip(&["-n", &hub, "link", "set", &hub_end, "master", &bridge, "up"])?;
            let cidr = format!("{}/{PREFIX_LEN}", address(k));
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", &node_end])?;
            ip(&["-n", &ns, "link", "set", &node_end, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let path = format!("{NETNS_DIR}/{ns}");
            let f = File::open(&path).map_err(|source| NetnsError::Open {
                path: path.clone(),
                source,
            })?;
            self.nodes.push(f);
        }
        stop(interrupted)
    }

    fn add_namespace(&mut self, name: &str) -> Result<(), NetnsError> {
        ip(&["netns", "add", name])?;
        self.created.push(name.to_string());
        Ok(())
    }

    /// The namespace node `k` runs in.
    pub fn node_namespace(&self, k: u16) -> String {
        format!("{}n{k}", self.prefix)
    }

    /// Makes `cmd` start in node `k`'s namespace.
    pub fn enter(&self, k: u16, cmd: &mut Command) {
        let fd: RawFd = self.nodes[k as usize].as_raw_fd();
        // SAFETY: the closure runs in the child between fork and exec and only makes the
        // setns system call on a descriptor the parent keeps open until the child is
        // reaped; setns is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }
}

/// Node `k`'s address on the node network.
pub fn address(k: u16) -> Ipv4Addr {
    Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], (k + 1) as u8)
}

impl Drop for Netns {
    /// Removes the namespaces, node namespaces first; the bridge and the veth pairs go with
    /// them. A namespace a process is still in lives on without its name until that process
    /// ends, so the caller ends the nodes first.
    fn drop(&mut self) {
        for ns in self.created.iter().rev() {
            if let Err(e) = ip(&["netns", "delete", ns]) {
                crate::say!("musubi: {e}; remove it with `ip netns delete {ns}`");
            }
        }
    }
}

/// Runs `ip ARGS`; an error names the command, its status and what it printed.
fn ip(args: &[&str]) -> Result<(), NetnsError> {
    let shown = || format!("`ip {}`", args.join(" "));
    let out = Command::new("ip")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                NetnsError::NoIp
            } else {
                NetnsError::RunIp {
                    command: shown(),
                    source,
                }
            }
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(NetnsError::IpFailed {
        command: shown(),
        status: out.status,
        said: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

/// Refuses, by name, a process that could not create or enter namespaces, before anything
/// is made.
fn check_privileges() -> Result<(), NetnsError> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(NetnsError::Status)?;
    let missing = missing_capabilities(&status);
    if missing.is_empty() {
        return Ok(());
    }
    Err(NetnsError::Privileges { missing })
}

/// The capabilities `--netns` needs that the `CapEff` line of a /proc status lacks.
fn missing_capabilities(status: &str) -> Vec<&'static str> {
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    [
        (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
        (CAP_NET_ADMIN, "CAP_NET_ADMIN"),
    ]
    .into_iter()
    .filter(|(bit, _)| eff & (1 << bit) == 0)
    .map(|(_, name)| name)
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_are_read_from_the_effective_set() {
        let root = "Name:\tmusubi\nCapEff:\t000001ffffffffff\n";
        assert!(missing_capabilities(root).is_empty());
        let user = "CapEff:\t0000000000000000\n";
        assert_eq!(
            missing_capabilities(user),
            ["CAP_SYS_ADMIN", "CAP_NET_ADMIN"]
        );
        let net_only = format!("CapEff:\t{:016x}\n", 1u64 << CAP_NET_ADMIN);
        assert_eq!(missing_capabilities(&net_only), ["CAP_SYS_ADMIN"]);
    }

    #[test]
    fn node_addresses_are_distinct_and_in_the_subnet() {
        assert_eq!(address(0), Ipv4Addr::new(10, 211, 0, 1));
        assert_eq!(address(MAX_NETNS_NODES - 1), Ipv4Addr::new(10, 211, 0, 253));
    }

    #[test]
    fn a_failing_ip_command_is_named_with_what_it_printed() {
        let e = ip(&["link", "show", "dev", "no-such-device-here"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`ip link show dev no-such-device-here` failed"),
            "{e}"
        );
        assert!(e.contains("no-such-device-here\""), "{e}");
    }
}
