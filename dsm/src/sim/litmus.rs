//! Litmus tests of the memory model a guest sees: small fixed per-vCPU programs run in the
//! simulator, and their recorded histories checked for the outcomes x86-TSO forbids.
//!
//! Each run draws from its seed everything the outcome may depend on: how many nodes, which
//! node and vCPU runs each thread (several threads may share a node, as vCPUs of one host
//! share its memory), which pages hold the two locations (and so their managers and first
//! owners), which nodes already hold copies or ownership before the test starts, network and
//! host delays, start times and think times. A value names the write that produced it
//! (every write in a run writes a fresh value), so a read "sees the write" exactly when it
//! returns something other than the location's value at the start of the test.

use super::{Failure, Sim, SimConfig, Workload};
use crate::node::{Ordering, Protocol};
use crate::rng::Rng;
use crate::types::{Access, PageNo};
use std::fmt;

/// The patterns checked. `x` and `y` are on different pages; all start at the same value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Litmus {
    /// Message passing. T0: `x = 1; y = 1`. T1: `r1 = y; r2 = x`. Forbidden: `r1` sees the
    /// write, `r2` does not (a reader sees the flag but not the data).
    Mp,
    /// Independent reads of independent writes. T0: `x = 1`. T1: `y = 1`. T2: `x; y`.
    /// T3: `y; x`. Forbidden: T2 sees x new and y old while T3 sees y new and x old (the two
    /// readers disagree on the order of the writes).
    Iriw,
    /// T0: `x = 1; y = 2`. T1: `y = 1; x = 2`. Forbidden: at the end x holds T0's write and
    /// y holds T1's (each thread's second write ordered before the other's first).
    TwoPlusTwoW,
}

impl Litmus {
    pub const ALL: [Litmus; 3] = [Litmus::Mp, Litmus::Iriw, Litmus::TwoPlusTwoW];

    /// Each thread's program over the locations `0` (x) and `1` (y).
    fn threads(self) -> &'static [&'static [(usize, Access)]] {
        use Access::{Read as R, Write as W};
        match self {
            Litmus::Mp => &[&[(0, W), (1, W)], &[(1, R), (0, R)]],
            Litmus::Iriw => &[&[(0, W)], &[(1, W)], &[(0, R), (1, R)], &[(1, R), (0, R)]],
            Litmus::TwoPlusTwoW => &[&[(0, W), (1, W)], &[(1, W), (0, W)]],
        }
    }
}

impl fmt::Display for Litmus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Litmus::Mp => "MP",
            Litmus::Iriw => "IRIW",
            Litmus::TwoPlusTwoW => "2+2W",
        })
    }
}

/// What one run showed.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub config: SimConfig,
    /// The histories matched the pattern's forbidden outcome.
    pub forbidden: bool,
    /// Where the threads ran and what each observed, for a report.
    pub describe: String,
}

/// Runs `test` once with everything drawn from `seed` (see the module comment).
pub fn run(
    test: Litmus,
    protocol: Protocol,
    ordering: Ordering,
    seed: u64,
) -> Result<Outcome, Failure> {
    let mut r = Rng::new(seed ^ 0x4C49_544D_5553);
    let threads = test.threads();
    let nodes = r.range(2, 5) as u16;
    let place: Vec<u16> = threads
        .iter()
        .map(|_| r.below(u64::from(nodes)) as u16)
        .collect();
    // Each thread gets the next free vCPU of its node.
    let slots: Vec<u16> = (0..threads.len())
        .map(|t| place[..t].iter().filter(|&&n| n == place[t]).count() as u16)
        .collect();
    let pages = r.range(2, 4);
    let x = r.below(pages);
    let y = (x + r.range(1, pages - 1)) % pages;
    let loc = [x, y];
    let cfg = SimConfig {
        protocol,
        ordering,
        seed,
        nodes,
        vcpus: slots.iter().max().map_or(1, |m| m + 1),
        pages,
        steps: 0,
        delay: r.range(1, 20),
        local: r.range(0, 5),
        think: r.range(0, 10),
        workload: Workload::Uniform { write_pct: 0 },
        hold: 0,
        retry: 0,
    };
    let mut sim = Sim::new(cfg);
    // Copies and owners before the test: each node reads, writes or leaves each location.
    for n in 0..nodes {
        for &page in &loc {
            let a = match r.below(4) {
                0 | 1 => Some(Access::Read),
                2 => Some(Access::Write),
                _ => None,
            };
            if let Some(a) = a {
                sim.access(n, 0, page, a)?;
                sim.run_until_quiet()?;
            }
        }
    }
    let init = loc.map(|p| sim.last_value(p));
    let mut programs = vec![vec![Vec::new(); cfg.vcpus as usize]; nodes as usize];
    for (t, prog) in threads.iter().enumerate() {
        programs[place[t] as usize][slots[t] as usize] = prog
            .iter()
            .map(|&(l, a)| (loc[l], a))
            .collect::<Vec<(PageNo, Access)>>();
    }
    sim.load_programs(programs);
    sim.run_until_quiet()?;
    let hist: Vec<Vec<u64>> = (0..threads.len())
        .map(|t| {
            sim.history(place[t], slots[t])
                .iter()
                .map(|o| o.value)
                .collect()
        })
        .collect();
    let new = |l: usize, v: u64| v != init[l];
    let forbidden = match test {
        Litmus::Mp => new(1, hist[1][0]) && !new(0, hist[1][1]),
        Litmus::Iriw => {
            new(0, hist[2][0]) && !new(1, hist[2][1]) && new(1, hist[3][0]) && !new(0, hist[3][1])
        }
        Litmus::TwoPlusTwoW => sim.last_value(x) == hist[0][0] && sim.last_value(y) == hist[1][0],
    };
    let describe = format!(
        "{test} {} ordering={} seed={seed:#x}: x=p{x} y=p{y} start {init:?}; {}; final x={} y={}",
        protocol.name(),
        ordering.name(),
        (0..threads.len())
            .map(|t| format!("T{t}@n{}v{} saw {:?}", place[t], slots[t], hist[t]))
            .collect::<Vec<_>>()
            .join(", "),
        sim.last_value(x),
        sim.last_value(y),
    );
    Ok(Outcome {
        config: cfg,
        forbidden,
        describe,
    })
}

/// Runs over a range of seeds: how many runs, how many forbidden, and the first forbidden one.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    pub runs: u64,
    pub forbidden: u64,
    pub first: Option<String>,
}

pub fn tally(
    test: Litmus,
    protocol: Protocol,
    ordering: Ordering,
    seeds: std::ops::Range<u64>,
) -> Result<Tally, Failure> {
    let mut t = Tally::default();
    for seed in seeds {
        let o = run(test, protocol, ordering, seed)?;
        t.runs += 1;
        if o.forbidden {
            t.forbidden += 1;
            t.first.get_or_insert(o.describe);
        }
    }
    Ok(t)
}
