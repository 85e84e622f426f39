//! The access streams of the simulated vCPUs.

use super::config::{SimConfig, Workload};
use crate::rng::Rng;
use crate::types::{Access, PageNo};

/// Whether this vCPU issues accesses at all.
pub(super) fn active(w: Workload, node: u16, vcpu: u16) -> bool {
    match w {
        Workload::PingPong => node < 2 && vcpu == 0,
        _ => true,
    }
}

pub(super) fn next(rng: &mut Rng, cfg: &SimConfig, node: u16, vcpu: u16) -> (PageNo, Access) {
    let pick = |rng: &mut Rng, write_pct: u8| {
        if rng.percent(write_pct) {
            Access::Write
        } else {
            Access::Read
        }
    };
    match cfg.workload {
        Workload::Uniform { write_pct } => (rng.below(cfg.pages), pick(rng, write_pct)),
        Workload::FalseSharing => (0, pick(rng, 50)),
        Workload::ReadStorm if node == 0 && vcpu == 0 => (0, pick(rng, 60)),
        Workload::ReadStorm => (0, Access::Read),
        Workload::PingPong => (0, Access::Write),
    }
}
