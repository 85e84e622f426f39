//! Random runs of the simulator over many seeds, targeted workloads, and replay of a failing
//! configuration (`DSM_REPLAY`).

use dsm::rng::Rng;
use dsm::sim::{self, shrink, Sim, SimConfig, Workload};
use dsm::{Access, Fixed, NodeId, Ordering, Prot, Protocol};
use std::sync::Arc;

fn check(cfg: SimConfig) -> sim::Stats {
    match sim::run(cfg) {
        Ok(s) => s,
        Err(f) => panic!("{}", shrink(f)),
    }
}

/// Random configurations for every node count from 2 to 16: vCPUs per node, pages, network
/// and host delays, think time and write share all drawn from the seed.
fn random_runs(protocol: Protocol, ordering: Ordering, seeds_per_size: u64, steps: u64) -> u64 {
    let mut meta = Rng::new(0xC0FFEE ^ protocol.name().len() as u64);
    let mut total = 0;
    let mut runs = 0;
    for nodes in 2..=16u16 {
        for _ in 0..seeds_per_size {
            let cfg = SimConfig {
                protocol,
                ordering,
                seed: meta.next_u64(),
                nodes,
                vcpus: meta.range(1, 4) as u16,
                pages: meta.range(1, 16),
                steps,
                delay: meta.range(1, 20),
                local: meta.range(0, 5),
                think: meta.range(0, 10),
                workload: Workload::Uniform {
                    write_pct: meta.range(0, 100) as u8,
                },
                hold: [0, 0, 5, 40][meta.below(4) as usize],
                retry: 0,
            };
            // A vCPU that retries late needs a hold at least as long (see below).
            let cfg = SimConfig {
                retry: [0, 0, 4, cfg.hold][meta.below(4) as usize].min(cfg.hold),
                ..cfg
            };
            total += check(cfg).steps;
            runs += 1;
        }
    }
    eprintln!(
        "{} {}: {runs} random runs, {total} steps",
        protocol.name(),
        ordering.name()
    );
    total
}

#[test]
fn vmp_random_runs() {
    assert!(random_runs(Protocol::Vmp, Ordering::Paper, 14, 20_000) > 4_000_000);
}

/// Under the default ordering the simulator allows no lagging copy at all.
#[test]
fn vmp_tso_random_runs() {
    assert!(random_runs(Protocol::Vmp, Ordering::Tso, 14, 20_000) > 4_000_000);
}

#[test]
fn ivy_random_runs() {
    assert!(random_runs(Protocol::Ivy, Ordering::Tso, 14, 20_000) > 4_000_000);
}

/// Protocol and ordering pairs worth running: Ivy ignores the ordering.
const MODES: [(Protocol, Ordering); 3] = [
    (Protocol::Vmp, Ordering::Paper),
    (Protocol::Vmp, Ordering::Tso),
    (Protocol::Ivy, Ordering::Tso),
];

/// False sharing on one page, read storms and write ping-pong, at several sizes.
#[test]
fn targeted_workloads() {
    let mut total = 0;
    for (protocol, ordering) in MODES {
        for workload in [
            Workload::FalseSharing,
            Workload::ReadStorm,
            Workload::PingPong,
        ] {
            for nodes in [2u16, 3, 5, 8, 16] {
                for seed in 0..6 {
                    let mut c = SimConfig::new(protocol, seed * 7919 + u64::from(nodes));
                    c.ordering = ordering;
                    c.nodes = nodes;
                    c.vcpus = 3;
                    c.pages = 1;
                    c.steps = 15_000;
                    c.delay = 1 + seed * 3;
                    c.workload = workload;
                    total += check(c).steps;
                }
            }
        }
    }
    eprintln!("targeted workloads: {total} steps");
}

/// One page shared by one vCPU on each of `nodes` nodes, for 20,000 steps.
fn one_page(
    protocol: Protocol,
    ordering: Ordering,
    seed: u64,
    nodes: u16,
    workload: Workload,
) -> SimConfig {
    let mut c = SimConfig::new(protocol, seed);
    c.ordering = ordering;
    c.nodes = nodes;
    c.vcpus = 1;
    c.pages = 1;
    c.steps = 20_000;
    c.workload = workload;
    c
}

/// Two nodes writing one page without pause (ping-pong): with no hold, a node loses the page
/// as soon as the other's request arrives, so it moves every few writes; with a hold of ten
/// network delays, each node gets many more writes done per visit of the page (the simulator
/// checks the invariants either way).
#[test]
fn a_hold_makes_a_write_shared_page_move_less_often_per_write() {
    for (protocol, ordering) in MODES {
        let run = |hold| {
            let mut c = one_page(protocol, ordering, 7, 2, Workload::PingPong);
            c.delay = 8;
            c.think = 1;
            c.hold = hold;
            let s = check(c);
            (s.by_kind.get("page").copied().unwrap_or(0), s.writes)
        };
        let (moves, writes) = run(0);
        let (held_moves, held_writes) = run(80);
        eprintln!(
            "{} {}: no hold {moves} page moves for {writes} writes; hold 80: {held_moves} for {held_writes}",
            protocol.name(),
            ordering.name()
        );
        assert!(
            held_moves * writes * 5 <= moves * held_writes,
            "with a hold, at most a fifth of the page moves per write: {held_moves} / \
             {held_writes} against {moves} / {writes}"
        );
    }
}

/// Holds of every length keep the invariants under every workload and node count.
#[test]
fn holds_keep_the_invariants_under_targeted_workloads() {
    for (protocol, ordering) in MODES {
        for workload in [
            Workload::FalseSharing,
            Workload::ReadStorm,
            Workload::PingPong,
        ] {
            for (nodes, hold) in [(2u16, 3u32), (3, 30), (5, 200), (8, 17)] {
                let mut c = SimConfig::new(protocol, u64::from(hold) * 31 + u64::from(nodes));
                c.ordering = ordering;
                c.nodes = nodes;
                c.vcpus = 2;
                c.pages = 2;
                c.steps = 8_000;
                c.workload = workload;
                c.hold = hold;
                check(c);
            }
        }
    }
}

/// The paper's ordering lets a reader see an old value while the invalidation is on its way
/// (the simulator allows exactly that window and counts it); the default ordering and Ivy
/// never do.
#[test]
fn stale_reads_only_under_asynchronous_invalidation() {
    let (mut vmp, mut tso, mut ivy) = (0, 0, 0);
    for seed in 0..10 {
        let mut c = SimConfig::new(Protocol::Vmp, seed);
        c.ordering = Ordering::Paper;
        c.workload = Workload::ReadStorm;
        c.nodes = 6;
        c.delay = 20;
        vmp += check(c).stale_reads;
        c.ordering = Ordering::Tso;
        tso += check(c).stale_reads;
        c.protocol = Protocol::Ivy;
        ivy += check(c).stale_reads;
    }
    assert!(vmp > 0, "expected reads inside the invalidation window");
    assert_eq!(tso, 0);
    assert_eq!(ivy, 0);
}

/// Every placement of requester, owner and manager over four nodes, with every set of other
/// read copies, for reads and writes; then the same with all four nodes faulting at once.
#[test]
fn every_role_combination() {
    let mut cases = 0;
    for (protocol, ordering) in MODES {
        for manager in 0..4u16 {
            for owner in 0..4u16 {
                for requester in 0..4u16 {
                    for copies in 0..16u16 {
                        for access in [Access::Read, Access::Write] {
                            for together in [false, true] {
                                role_case(
                                    protocol, ordering, manager, owner, requester, copies, access,
                                    together,
                                );
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    eprintln!("role combinations: {cases}");
}

#[allow(clippy::too_many_arguments)]
fn role_case(
    protocol: Protocol,
    ordering: Ordering,
    manager: u16,
    owner: u16,
    requester: u16,
    copies: u16,
    access: Access,
    together: bool,
) {
    let cfg = SimConfig {
        protocol,
        ordering,
        seed: u64::from(manager * 1000 + owner * 100 + requester * 10 + copies),
        nodes: 4,
        vcpus: 2,
        pages: 1,
        steps: 0,
        delay: 3,
        local: 2,
        think: 0,
        workload: Workload::Uniform { write_pct: 0 },
        hold: 0,
        retry: 0,
    };
    let placement = Fixed {
        nodes: 4,
        pages: vec![(0, NodeId(manager), NodeId(owner))],
    };
    let case = format!(
        "{} {} manager n{manager} owner n{owner} requester n{requester} copies {copies:04b} {access} together {together}",
        protocol.name(),
        ordering.name()
    );
    let mut sim = Sim::with_placement(cfg, Arc::new(placement));
    let run = |sim: &mut Sim| -> Result<(), dsm::sim::Failure> {
        for k in (0..4).filter(|k| copies & (1 << k) != 0 && *k != owner) {
            sim.access(k, 0, 0, Access::Read)?;
            sim.run_until_quiet()?;
        }
        sim.access(requester, 0, 0, access)?;
        if together {
            for k in (0..4).filter(|k| *k != requester) {
                let a = if k % 2 == 0 {
                    Access::Write
                } else {
                    Access::Read
                };
                sim.access(k, 1, 0, a)?;
            }
            // A second vCPU on the requester's node wanting the other access.
            let other = if access == Access::Read {
                Access::Write
            } else {
                Access::Read
            };
            sim.access(requester, 1, 0, other)?;
        }
        sim.run_until_quiet()
    };
    if let Err(f) = run(&mut sim) {
        panic!("{case}: {f}");
    }
    if !together {
        let prot = sim.node(requester).prot(0);
        assert!(prot.permits(access), "{case}: requester left with {prot:?}");
        if access == Access::Write {
            for k in (0..4).filter(|k| *k != requester) {
                assert_eq!(sim.node(k).prot(0), Prot::None, "{case}: n{k} kept access");
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

/// After writes move pages around, each manager's directory names the writer as owner, under
/// both protocols; a page never touched counts for its initial owner, and pages managed
/// elsewhere are not counted.
#[test]
fn the_directory_counts_the_pages_a_node_owns() {
    for (protocol, ordering) in MODES {
        let cfg = SimConfig {
            protocol,
            ordering,
            seed: 1,
            nodes: 3,
            vcpus: 1,
            pages: 9,
            steps: 0,
            delay: 3,
            local: 1,
            think: 0,
            workload: Workload::Uniform { write_pct: 0 },
            hold: 0,
            retry: 0,
        };
        let pages = cfg.pages;
        // Page 7 starts on node 2 though node 1 manages it.
        let placement = Fixed {
            nodes: 3,
            pages: vec![(7, NodeId(1), NodeId(2))],
        };
        let mut sim = Sim::with_placement(cfg, Arc::new(placement));
        // Node 2 writes pages 0 and 3 (managed by 0) and 4 (managed by 1); node 1 reads 6.
        for (node, page, access) in [
            (2, 0, Access::Write),
            (2, 3, Access::Write),
            (2, 4, Access::Write),
            (1, 6, Access::Read),
        ] {
            sim.access(node, 0, page, access).unwrap();
            sim.run_until_quiet().unwrap();
        }
        let owned = |at: u16, peer: u16| sim.node(at).pages_owned_by(NodeId(peer), 0..pages);
        let what = protocol.name();
        assert_eq!(owned(0, 2), 2, "{what}: pages 0 and 3");
        assert_eq!(owned(1, 2), 2, "{what}: page 4, and page 7 untouched");
        assert_eq!(owned(0, 1), 0, "{what}: a read copy is not ownership");
        assert_eq!(owned(0, 0), 1, "{what}: page 6 stays with node 0");
        assert_eq!(owned(2, 2), 3, "{what}: pages 2, 5 and 8, never touched");
        assert_eq!(owned(0, 2) + owned(1, 2) + owned(2, 2), 7);
    }
}

/// Paper 004 on 16 cores: four nodes with `--ordering paper` never finished. A vCPU that was
/// given a page uses it only some time later (it re-enters the guest, or waits for KVM's
/// page-fault worker); when another node can take the page back sooner, every node keeps
/// getting the page and losing it before use, and vCPUs starve. Here four nodes share one
/// page and retry 20 to 40 ticks after their resume: without a hold a vCPU waits past the
/// simulator's bound; with a hold longer than the retry, no retry finds its page gone and
/// every wait is bounded.
#[test]
fn a_hold_longer_than_a_retry_keeps_vcpus_that_retry_late_from_starving() {
    for (protocol, ordering) in MODES {
        let config = |hold| {
            let mut c = one_page(protocol, ordering, 11, 4, Workload::FalseSharing);
            c.delay = 4;
            c.think = 2;
            c.retry = 40;
            c.hold = hold;
            c
        };
        let starved = sim::run(config(0)).expect_err("no hold: a vCPU starves");
        assert!(starved.what.contains("has waited"), "{starved}");
        let s = check(config(60));
        assert_eq!(s.refaults, 0, "{} {}", protocol.name(), ordering.name());
        assert!(s.writes > 5_000, "{s:?}");
    }
}

/// A report on a stuck fault names the copy's state here and who manages the page.
#[test]
fn a_node_describes_its_copy_and_its_managers_record_of_a_page() {
    let mut c = SimConfig::new(Protocol::Vmp, 3);
    c.nodes = 3;
    c.pages = 3;
    let mut sim = Sim::new(c);
    // Page 1 is managed and first owned by node 1; node 2 writes it.
    sim.access(2, 0, 1, Access::Write).unwrap();
    sim.run_until_quiet().unwrap();
    let at_writer = sim.node(2).describe(1);
    assert!(
        at_writer.starts_with("copy here: ReadWrite (current, owner)"),
        "{at_writer}"
    );
    assert!(at_writer.ends_with("managed by n1"), "{at_writer}");
    let at_manager = sim.node(1).describe(1);
    assert!(
        at_manager.contains("managed here: owner n2"),
        "{at_manager}"
    );
    let untouched = sim.node(0).describe(2);
    assert!(untouched.starts_with("no copy here"), "{untouched}");
    assert!(untouched.ends_with("managed by n2"), "{untouched}");
}
