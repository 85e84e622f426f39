//! The network of a replicated VM's tests and benchmark: the primary's and the standby's
//! TAPs each on a bridge in a namespace of their own, and a client namespace whose bridge
//! joins both over veth pairs. The guest keeps one address wherever it runs, so the client
//! reaches whichever of the two runs it; the replication link runs between the two hosts'
//! bridge addresses over the same wires. Every interface lives in the three namespaces,
//! which go (and everything in them) when this is dropped.

use crate::netns::{try_ip, IpError, Netns};

/// The client's address, on its bridge.
pub const CLIENT: &str = "10.9.0.1";
/// The guest's (`probe.ip=GUEST/24`), on the primary and then on the standby.
pub const GUEST: &str = "10.9.0.2";
/// The primary's host, on its bridge.
pub const PRIMARY_HOST: &str = "10.9.0.11";
/// The standby's host, on its bridge: where it listens for its primary.
pub const STANDBY_HOST: &str = "10.9.0.12";
/// The TAP in the primary's and the standby's namespaces (`--net tap=TAP`).
pub const TAP: &str = "tap0";

/// The three namespaces and what joins them.
pub struct ReplicaNet {
    pub primary: Netns,
    pub standby: Netns,
    pub client: Netns,
}

impl ReplicaNet {
    /// Namespaces `musubi-t<pid>-<tag>p`, `...s` and `...c`; needs root, a test fails
    /// without it.
    pub fn new(tag: &str) -> ReplicaNet {
        ReplicaNet::try_new(tag).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`ReplicaNet::new`], or why it could not be made (what was made is deleted).
    pub fn try_new(tag: &str) -> Result<ReplicaNet, IpError> {
        let net = ReplicaNet {
            primary: Netns::try_new(&format!("{tag}p"))?,
            standby: Netns::try_new(&format!("{tag}s"))?,
            client: Netns::try_new(&format!("{tag}c"))?,
        };
        let c = net.client.name.as_str();
        try_ip(&["-n", c, "link", "add", "br0", "type", "bridge"])?;
        for (ns, addr, veth) in [
            (&net.primary, PRIMARY_HOST, "vp"),
            (&net.standby, STANDBY_HOST, "vs"),
        ] {
            let n = ns.name.as_str();
            let peer = format!("{veth}c");
            try_ip(&["-n", n, "link", "add", "br0", "type", "bridge"])?;
            try_ip(&["-n", n, "tuntap", "add", "dev", TAP, "mode", "tap"])?;
            try_ip(&[
                "-n", n, "link", "add", veth, "type", "veth", "peer", "name", &peer, "netns", c,
            ])?;
            for port in [TAP, veth] {
                try_ip(&["-n", n, "link", "set", port, "master", "br0", "up"])?;
            }
            try_ip(&["-n", n, "addr", "add", &format!("{addr}/24"), "dev", "br0"])?;
            try_ip(&["-n", n, "link", "set", "br0", "up"])?;
            try_ip(&["-n", c, "link", "set", &peer, "master", "br0", "up"])?;
        }
        try_ip(&[
            "-n",
            c,
            "addr",
            "add",
            &format!("{CLIENT}/24"),
            "dev",
            "br0",
        ])?;
        try_ip(&["-n", c, "link", "set", "br0", "up"])?;
        Ok(net)
    }

    /// [`Netns::delete_on_signal`] for all three.
    pub fn delete_on_signal(&self) -> Result<(), String> {
        for ns in [&self.primary, &self.standby, &self.client] {
            ns.delete_on_signal()?;
        }
        Ok(())
    }
}
