//! Random runs of the simulator over many seeds, targeted workloads, and replay of a failing
//! configuration (`DSM_REPLAY`).

use dsm::sim::{self, shrink, SimConfig, Workload};
use dsm::Protocol;

fn check(cfg: SimConfig) -> sim::Stats {
    match sim::run(cfg) {
        Ok(s) => s,
        Err(f) => panic!("{}", shrink(f)),
    }
}

#[test]
fn smoke() {
    for p in [Protocol::Vmp, Protocol::Ivy] {
        for w in [
            Workload::Uniform { write_pct: 30 },
            Workload::FalseSharing,
            Workload::ReadStorm,
            Workload::PingPong,
        ] {
            for seed in 0..20 {
                let mut c = SimConfig::new(p, seed);
                c.workload = w;
                c.steps = 5000;
                let s = check(c);
                if seed == 0 {
                    eprintln!("{c}: {s:?}");
                }
            }
        }
    }
}

#[test]
fn replay() {
    let Ok(line) = std::env::var("DSM_REPLAY") else {
        return;
    };
    let cfg: SimConfig = line.parse().expect("DSM_REPLAY");
    let (r, trace) = sim::run_traced(cfg);
    for l in &trace {
        println!("{l}");
    }
    if let Err(f) = r {
        panic!("{f}");
    }
}
