//! A simulation's parameters, written as one line so a failing run can be pasted back to
//! replay it (`DSM_REPLAY`).

use crate::node::{Ordering, Protocol};
use std::fmt;
use std::str::FromStr;

/// What the vCPUs do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// Each access picks a page uniformly and writes with this probability (percent).
    Uniform { write_pct: u8 },
    /// Every vCPU reads and writes page 0, half of the accesses writes.
    FalseSharing,
    /// One vCPU (node 0, vCPU 0) keeps writing page 0; everyone else keeps reading it.
    ReadStorm,
    /// vCPU 0 of nodes 0 and 1 write page 0 in turn-less alternation; the rest stay idle.
    PingPong,
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Workload::Uniform { write_pct } => write!(f, "uniform:{write_pct}"),
            Workload::FalseSharing => f.write_str("false-sharing"),
            Workload::ReadStorm => f.write_str("read-storm"),
            Workload::PingPong => f.write_str("ping-pong"),
        }
    }
}

impl FromStr for Workload {
    type Err = String;
    fn from_str(s: &str) -> Result<Workload, String> {
        Ok(match s {
            "false-sharing" => Workload::FalseSharing,
            "read-storm" => Workload::ReadStorm,
            "ping-pong" => Workload::PingPong,
            _ => match s.strip_prefix("uniform:").map(str::parse::<u8>) {
                Some(Ok(p)) if p <= 100 => Workload::Uniform { write_pct: p },
                _ => {
                    return Err(format!(
                    "workload {s:?}: expected uniform:<0-100>, false-sharing, read-storm or ping-pong"
                ))
                }
            },
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimConfig {
    pub protocol: Protocol,
    /// What the guest may observe (asynchronous protocol only; Ivy ignores it).
    pub ordering: Ordering,
    pub seed: u64,
    /// 2 to 16 in the tests; anything up to `MAX_NODES` works.
    pub nodes: u16,
    /// vCPUs per node, faulting independently.
    pub vcpus: u16,
    /// Pages `0..pages` are used.
    pub pages: u64,
    /// Events to process before the vCPUs stop issuing accesses and the run drains.
    pub steps: u64,
    /// Network delay of a message, uniform in `1..=delay` ticks; each sender/receiver pair
    /// stays in order, different pairs overtake each other.
    pub delay: u64,
    /// Host completion delay (`PageSent`, `PageInstalled`), uniform in `0..=local` ticks.
    pub local: u64,
    /// Ticks a vCPU computes between two accesses, uniform in `0..=think`.
    pub think: u64,
    pub workload: Workload,
    /// Ticks a page stays at a node that was just given it ([`crate::Config::hold`]).
    pub hold: u32,
    /// Ticks from a vCPU's resume to its retried access, uniform in `retry/2..=retry` (0: it
    /// accesses at once). A real vCPU re-enters the guest, or waits for KVM's page-fault
    /// worker, before it retries; the page can be taken away meanwhile, and then it faults
    /// again.
    pub retry: u32,
}

impl SimConfig {
    pub fn new(protocol: Protocol, seed: u64) -> SimConfig {
        SimConfig {
            protocol,
            ordering: Ordering::default(),
            seed,
            nodes: 4,
            vcpus: 2,
            pages: 8,
            steps: 10_000,
            delay: 8,
            local: 3,
            think: 4,
            workload: Workload::Uniform { write_pct: 30 },
            hold: 0,
            retry: 0,
        }
    }
}

impl fmt::Display for SimConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ordering={} nodes={} vcpus={} pages={} steps={} delay={} local={} think={} workload={} hold={} retry={} seed={:#x}",
            self.protocol.name(),
            self.ordering.name(),
            self.nodes,
            self.vcpus,
            self.pages,
            self.steps,
            self.delay,
            self.local,
            self.think,
            self.workload,
            self.hold,
            self.retry,
            self.seed
        )
    }
}

impl FromStr for SimConfig {
    type Err = String;
    fn from_str(s: &str) -> Result<SimConfig, String> {
        let mut words = s.split_whitespace();
        let first = words.next().unwrap_or("");
        let protocol: Protocol = first
            .parse()
            .map_err(|e| format!("protocol {first:?}: {e}"))?;
        let mut c = SimConfig::new(protocol, 0);
        for w in words {
            let (k, v) = w
                .split_once('=')
                .ok_or_else(|| format!("{w:?}: expected key=value"))?;
            let num = || -> Result<u64, String> {
                let r = match v.strip_prefix("0x") {
                    Some(h) => u64::from_str_radix(h, 16),
                    None => v.parse(),
                };
                r.map_err(|_| format!("{k}={v:?}: expected a number"))
            };
            match k {
                "nodes" => c.nodes = num()?.try_into().map_err(|_| format!("nodes={v}"))?,
                "vcpus" => c.vcpus = num()?.try_into().map_err(|_| format!("vcpus={v}"))?,
                "pages" => c.pages = num()?,
                "steps" => c.steps = num()?,
                "delay" => c.delay = num()?,
                "local" => c.local = num()?,
                "think" => c.think = num()?,
                "hold" => c.hold = num()?.try_into().map_err(|_| format!("hold={v}"))?,
                "retry" => c.retry = num()?.try_into().map_err(|_| format!("retry={v}"))?,
                "seed" => c.seed = num()?,
                "workload" => c.workload = v.parse()?,
                "ordering" => {
                    c.ordering = v.parse().map_err(|e| format!("ordering={v:?}: {e}"))?;
                }
                _ => return Err(format!("unknown key {k:?}")),
            }
        }
        Ok(c)
    }
}
