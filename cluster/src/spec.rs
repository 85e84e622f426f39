//! Who the nodes of a multi-node VM are: addresses, vCPUs, protocol and the shared secret,
//! checked against the VM before any node starts.

use std::net::SocketAddr;
use vmm::config::VmConfig;

/// The most nodes one VM spans (the protocol's limit).
pub const MAX_NODES: usize = dsm::types::MAX_NODES;

/// One node: where it listens and the global ids of the vCPUs it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeAddr {
    pub address: SocketAddr,
    pub vcpus: Vec<u8>,
}

/// Everything every node of one VM must agree on besides the VM itself.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    pub nodes: Vec<NodeAddr>,
    pub protocol: dsm::Protocol,
    pub ordering: dsm::Ordering,
    /// The node that holds the devices and boots the guest; it runs vCPU 0.
    pub io_node: u16,
    /// Proves to each peer that a node belongs to this VM.
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for ClusterSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSpec")
            .field("nodes", &self.nodes)
            .field("protocol", &self.protocol)
            .field("ordering", &self.ordering)
            .field("io_node", &self.io_node)
            .field("secret", &"<redacted>")
            .finish()
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ClusterError {
    #[error("nodes: a VM spans 1 to {MAX_NODES} nodes, the cluster lists {0}")]
    NodeCount(usize),
    #[error("nodes[{node}].vcpus: vCPU {vcpu} is outside the VM's {cpus} vCPUs (cpus = {cpus})")]
    NoSuchVcpu { node: usize, vcpu: u8, cpus: u8 },
    #[error("nodes[{node}].vcpus: vCPU {vcpu} is already run by node {other}")]
    TwiceAssigned { node: usize, vcpu: u8, other: usize },
    #[error("vCPU {0} is run by no node: every vCPU of the VM needs one")]
    Unassigned(u8),
    #[error("nodes[{0}].vcpus is empty: a node without vCPUs only adds page traffic")]
    NoVcpus(usize),
    #[error("io_node {io}: the cluster has nodes 0..{nodes}")]
    NoIoNode { io: u16, nodes: usize },
    #[error(
        "io_node {io} must run vCPU 0, the CPU that boots the guest (it runs on node {holder})"
    )]
    BspElsewhere { io: u16, holder: usize },
    #[error("--id {id}: the cluster has nodes 0..{nodes}")]
    NoSuchNode { id: u16, nodes: usize },
    #[error("nodes[{a}] and nodes[{b}] both listen on {addr}")]
    SameAddress {
        a: usize,
        b: usize,
        addr: SocketAddr,
    },
    #[error(
        "--pmem with {0} nodes: a file mapped into guest memory is not kept coherent across \
         hosts (each node would see its own copy); use --disk, or run on one node"
    )]
    Pmem(usize),
    #[error("the secret is empty: give every node the same secret file with at least 16 bytes")]
    ShortSecret,
}

impl ClusterSpec {
    /// Checks the cluster against the VM it is to run, and that node `me` is in it.
    pub fn check(&self, config: &VmConfig, me: u16) -> Result<(), ClusterError> {
        let n = self.nodes.len();
        if n == 0 || n > MAX_NODES {
            return Err(ClusterError::NodeCount(n));
        }
        if me as usize >= n {
            return Err(ClusterError::NoSuchNode { id: me, nodes: n });
        }
        if self.io_node as usize >= n {
            return Err(ClusterError::NoIoNode {
                io: self.io_node,
                nodes: n,
            });
        }
        if self.secret.len() < 16 {
            return Err(ClusterError::ShortSecret);
        }
        let mut holder: Vec<Option<usize>> = vec![None; config.cpus as usize];
        for (i, node) in self.nodes.iter().enumerate() {
            if node.vcpus.is_empty() {
                return Err(ClusterError::NoVcpus(i));
            }
            if let Some(j) = self.nodes[..i]
                .iter()
                .position(|o| o.address == node.address)
            {
                return Err(ClusterError::SameAddress {
                    a: j,
                    b: i,
                    addr: node.address,
                });
            }
            for &v in &node.vcpus {
                match holder.get_mut(v as usize) {
                    None => {
                        return Err(ClusterError::NoSuchVcpu {
                            node: i,
                            vcpu: v,
                            cpus: config.cpus,
                        })
                    }
                    Some(Some(other)) => {
                        return Err(ClusterError::TwiceAssigned {
                            node: i,
                            vcpu: v,
                            other: *other,
                        })
                    }
                    Some(slot) => *slot = Some(i),
                }
            }
        }
        if let Some(v) = holder.iter().position(Option::is_none) {
            return Err(ClusterError::Unassigned(v as u8));
        }
        let bsp = holder[0].expect("checked above");
        if bsp != self.io_node as usize {
            return Err(ClusterError::BspElsewhere {
                io: self.io_node,
                holder: bsp,
            });
        }
        if n > 1 && !config.pmem.is_empty() {
            return Err(ClusterError::Pmem(n));
        }
        Ok(())
    }

    /// The node that runs vCPU `vcpu`.
    pub fn node_of(&self, vcpu: u8) -> Option<u16> {
        self.nodes
            .iter()
            .position(|n| n.vcpus.contains(&vcpu))
            .map(|i| i as u16)
    }

    /// `cpus` vCPUs dealt round-robin over `addresses`, node 0 serving I/O: what
    /// `musubi run --nodes N` starts on one host.
    pub fn round_robin(
        addresses: &[SocketAddr],
        cpus: u8,
        protocol: dsm::Protocol,
        ordering: dsm::Ordering,
        secret: Vec<u8>,
    ) -> ClusterSpec {
        let n = addresses.len().max(1);
        ClusterSpec {
            nodes: addresses
                .iter()
                .enumerate()
                .map(|(i, &address)| NodeAddr {
                    address,
                    vcpus: (0..cpus).filter(|v| *v as usize % n == i).collect(),
                })
                .collect(),
            protocol,
            ordering,
            io_node: 0,
            secret,
        }
    }

    /// What the configuration hash covers besides the VM: a node with another protocol or
    /// another split of the vCPUs would corrupt memory as surely as one with another RAM size.
    pub fn canonical(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("{}={:?}", n.address, n.vcpus))
            .collect();
        format!(
            "protocol={} ordering={} io_node={} nodes=[{}]",
            self.protocol.name(),
            self.ordering.name(),
            self.io_node,
            nodes.join(",")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm::config::{ExitsMode, KernelImage, SerialMode};

    fn vm(cpus: u8) -> VmConfig {
        VmConfig {
            kernel: KernelImage::File("k".into()),
            cmdline: String::new(),
            initrd: None,
            cpus,
            memory: 64 << 20,
            disks: Vec::new(),
            pmem: Vec::new(),
            net: Vec::new(),
            rng: None,
            vsock: None,
            serial: SerialMode::Off,
            exits: ExitsMode::Kernel,
        }
    }

    fn addrs(n: u16) -> Vec<SocketAddr> {
        (0..n)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 7000 + i)))
            .collect()
    }

    fn spec(nodes: u16, cpus: u8) -> ClusterSpec {
        ClusterSpec::round_robin(
            &addrs(nodes),
            cpus,
            dsm::Protocol::Vmp,
            dsm::Ordering::Tso,
            vec![7; 32],
        )
    }

    #[test]
    fn round_robin_deals_every_vcpu_once() {
        let c = spec(3, 4);
        assert_eq!(c.nodes[0].vcpus, vec![0, 3]);
        assert_eq!(c.nodes[1].vcpus, vec![1]);
        assert_eq!(c.nodes[2].vcpus, vec![2]);
        assert_eq!(c.check(&vm(4), 2), Ok(()));
        assert_eq!(c.node_of(3), Some(0));
        assert_eq!(c.node_of(9), None);
        assert!(c
            .canonical()
            .contains("protocol=vmp ordering=tso io_node=0"));
        assert!(
            !format!("{c:?}").contains("7, 7"),
            "the secret is not printed"
        );
    }

    #[test]
    fn bad_clusters_are_refused_by_name() {
        let msg = |c: &ClusterSpec, v: &VmConfig, me| c.check(v, me).unwrap_err().to_string();
        let c = spec(2, 2);
        assert!(msg(&c, &vm(2), 2).contains("--id 2"));
        assert!(msg(&c, &vm(1), 0).contains("nodes[1].vcpus: vCPU 1 is outside"));
        assert!(msg(&spec(3, 2), &vm(2), 0).contains("nodes[2].vcpus is empty"));
        let mut twice = spec(2, 2);
        twice.nodes[1].vcpus.push(0);
        assert!(msg(&twice, &vm(2), 0).contains("already run by node 0"));
        let mut io = spec(2, 2);
        io.io_node = 1;
        assert!(msg(&io, &vm(2), 0).contains("must run vCPU 0"));
        assert!(msg(&c, &vm(3), 0).contains("vCPU 2 is run by no node"));
        let mut short = spec(2, 2);
        short.secret = b"x".to_vec();
        assert!(msg(&short, &vm(2), 0).contains("secret"));
        let mut same = spec(2, 2);
        same.nodes[1].address = same.nodes[0].address;
        assert!(msg(&same, &vm(2), 0).contains("both listen"));
        let mut with_pmem = vm(2);
        with_pmem.pmem.push("file=/x,size=4M".parse().unwrap());
        assert!(msg(&c, &with_pmem, 0).contains("--pmem with 2 nodes"));
        assert_eq!(spec(1, 2).check(&with_pmem, 0), Ok(()));
    }
}
