//! Table 3 of Kaneda et al.: messages per page fetch and critical-path length, for Ivy and for
//! the paper's protocol, by access and by where the page's manager sits, measured in the
//! simulator and printed beside the paper's figures.
//!
//! Each cell is one fetch in an otherwise idle system: node 0 requests, node 1 owns the page,
//! node 2 is the third node, nodes 3.. hold the `c` other read copies. `c` counts copies other
//! than the requester's and the owner's, which is the reading under which the paper's
//! message counts come out (its owner answers with the page rather than being invalidated
//! by a message of its own).
//!
//! Two path lengths are measured, because the paper's column is not one of them throughout:
//! `to_resume` is the longest chain of messages, each caused by the previous, before the
//! faulting vCPU runs again; `whole` is the longest chain of the whole fetch, including what is
//! sent after the resume (the paper's `finish`). The paper's critical path equals `to_resume`
//! for every Ivy cell and for the asynchronous protocol's reads, and `whole` for its writes:
//! by `to_resume` those writes are one message shorter whenever the manager is not the
//! requester. Ivy's write figures (4 and 5) assume at least one copy to invalidate; with
//! `c = 0` the invalidation round trip is absent and the path is two shorter.
//!
//! The paper's cells are measured with [`Ordering::Paper`]. The asynchronous protocol's
//! default, [`Ordering::Tso`], is measured too ([`tso_extra`]): reads are unchanged, a write
//! costs one acknowledgement per other copy and, when `c >= 1`, two more messages in sequence.

use crate::node::{Ordering, Protocol};
use crate::placement::Fixed;
use crate::sim::{Failure, Sim, SimConfig, Workload};
use crate::types::{Access, NodeId};
use std::fmt::Write;
use std::sync::Arc;

/// Where the page's manager is, relative to the fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ManagerAt {
    Requester,
    Owner,
    Third,
}

impl ManagerAt {
    pub const ALL: [ManagerAt; 3] = [ManagerAt::Requester, ManagerAt::Owner, ManagerAt::Third];

    pub fn name(self) -> &'static str {
        match self {
            ManagerAt::Requester => "requester",
            ManagerAt::Owner => "owner",
            ManagerAt::Third => "other",
        }
    }
}

/// One measured cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cell {
    pub protocol: Protocol,
    pub ordering: Ordering,
    pub access: Access,
    pub manager: ManagerAt,
    pub c: u32,
    pub messages: u64,
    pub to_resume: u32,
    pub whole: u32,
}

/// The paper's Table 3: `(messages, critical path)` as printed, with `c` substituted.
pub fn paper(protocol: Protocol, access: Access, m: ManagerAt, c: u32) -> (u64, u32) {
    let c = u64::from(c);
    use Access::*;
    use ManagerAt::*;
    match (protocol, access, m) {
        (Protocol::Ivy, Read, Requester) => (2, 2),
        (Protocol::Ivy, Read, Owner) => (2, 2),
        (Protocol::Ivy, Read, Third) => (3, 3),
        (Protocol::Ivy, Write, Requester) => (2 + 2 * c, 4),
        (Protocol::Ivy, Write, Owner) => (2 + 2 * c, 4),
        (Protocol::Ivy, Write, Third) => (3 + 2 * c, 5),
        (Protocol::Vmp, Read, Requester) => (2, 2),
        (Protocol::Vmp, Read, Owner) => (3, 2),
        (Protocol::Vmp, Read, Third) => (4, 3),
        (Protocol::Vmp, Write, Requester) => (2 + c, 2),
        (Protocol::Vmp, Write, Owner) => (3 + c, 3),
        (Protocol::Vmp, Write, Third) => (4 + c, 4),
    }
}

/// The paper's formula for the message count, as printed.
fn paper_formula(protocol: Protocol, access: Access, m: ManagerAt) -> String {
    let (m0, _) = paper(protocol, access, m, 0);
    let (m1, _) = paper(protocol, access, m, 1);
    match m1 - m0 {
        0 => m0.to_string(),
        1 => format!("{m0} + c"),
        k => format!("{m0} + {k}c"),
    }
}

/// What [`Ordering::Tso`] adds to the paper's cell: `(messages, critical path)`. Each of the
/// `c` copies acknowledges its invalidation to the manager (the Table 3 layout never makes a
/// copy holder the manager, so none of these is a loopback), and the owner's `inv` waits for
/// the last acknowledgement: `inv` then `inval-ack` come before it on the path.
pub fn tso_extra(protocol: Protocol, access: Access, c: u32) -> (u64, u32) {
    match (protocol, access) {
        (Protocol::Vmp, Access::Write) if c > 0 => (u64::from(c), 2),
        _ => (0, 0),
    }
}

/// Runs one fetch in the simulator, with the paper's fire-and-forget invalidations, and
/// counts it.
pub fn measure(protocol: Protocol, access: Access, m: ManagerAt, c: u32) -> Result<Cell, Failure> {
    measure_ordered(protocol, Ordering::Paper, access, m, c)
}

/// [`measure`] under either ordering.
pub fn measure_ordered(
    protocol: Protocol,
    ordering: Ordering,
    access: Access,
    m: ManagerAt,
    c: u32,
) -> Result<Cell, Failure> {
    let (req, owner, third) = (0u16, 1u16, 2u16);
    let manager = match m {
        ManagerAt::Requester => req,
        ManagerAt::Owner => owner,
        ManagerAt::Third => third,
    };
    let nodes = 3 + c as u16;
    let cfg = SimConfig {
        protocol,
        ordering,
        seed: 0,
        nodes,
        vcpus: 1,
        pages: 1,
        steps: 0,
        delay: 1,
        local: 0,
        think: 0,
        workload: Workload::Uniform { write_pct: 0 },
        hold: 0,
        retry: 0,
    };
    let placement = Fixed {
        nodes,
        pages: vec![(0, NodeId(manager), NodeId(owner))],
    };
    let mut sim = Sim::with_placement(cfg, Arc::new(placement));
    for k in 3..nodes {
        sim.access(k, 0, 0, Access::Read)?;
        sim.run_until_quiet()?;
    }
    sim.reset_stats();
    sim.access(req, 0, 0, access)?;
    sim.run_until_quiet()?;
    let s = &sim.stats;
    Ok(Cell {
        protocol,
        ordering,
        access,
        manager: m,
        c,
        messages: s.messages,
        to_resume: s.last_resume_depth.unwrap_or(0),
        whole: s.max_depth,
    })
}

/// Every cell for `c` in `0..=max_c`, Ivy first, then the paper's protocol, as in the paper.
pub fn measure_all(max_c: u32) -> Result<Vec<Cell>, Failure> {
    measure_all_ordered(Ordering::Paper, max_c)
}

/// [`measure_all`] under either ordering (Ivy's cells do not depend on it).
pub fn measure_all_ordered(ordering: Ordering, max_c: u32) -> Result<Vec<Cell>, Failure> {
    let mut cells = Vec::new();
    for protocol in [Protocol::Ivy, Protocol::Vmp] {
        for access in [Access::Read, Access::Write] {
            for m in ManagerAt::ALL {
                for c in 0..=max_c {
                    cells.push(measure_ordered(protocol, ordering, access, m, c)?);
                }
            }
        }
    }
    Ok(cells)
}

/// The rows of the printed table: Ivy, the paper's protocol, and its x86-safe default.
const ROWS: [(&str, Protocol, Ordering); 3] = [
    ("Ivy", Protocol::Ivy, Ordering::Paper),
    ("VMP", Protocol::Vmp, Ordering::Paper),
    ("VMP-TSO", Protocol::Vmp, Ordering::Tso),
];

/// The table as text: the paper's figures and ours for `c` = 0..=3.
pub fn render() -> String {
    const MAX_C: u32 = 3;
    let cells = match measure_all(MAX_C).and_then(|mut c| {
        c.extend(measure_all_ordered(Ordering::Tso, MAX_C)?);
        Ok(c)
    }) {
        Ok(c) => c,
        Err(f) => return format!("the Table 3 scenarios failed in the simulator:\n{f}"),
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Table 3 (Kaneda, Oyama, Yonezawa 2005): messages per page fetch and critical path"
    );
    let _ = writeln!(
        s,
        "c = copies other than the requester's and the owner's; measured columns are c = 0..{MAX_C}"
    );
    let cs: String = (0..=MAX_C).map(|c| format!("{c:>3}")).collect();
    let w = cs.len();
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<27} | {:<8} {:<w$} | {:<5} {:<w$} | {:<w$}",
        "", "messages", "", "path", "to resume", "whole fetch"
    );
    let _ = writeln!(
        s,
        "{:<8} {:<6} {:<11} | {:<8} {:<w$} | {:<5} {:<w$} | {:<w$}",
        "protocol", "access", "manager", "paper", cs, "paper", cs, cs
    );
    let _ = writeln!(
        s,
        "{}",
        "-".repeat(27 + 3 + 8 + 1 + w + 3 + 5 + 1 + w + 3 + w)
    );
    for (label, protocol, ordering) in ROWS {
        for access in [Access::Read, Access::Write] {
            for m in ManagerAt::ALL {
                let row: Vec<&Cell> = cells
                    .iter()
                    .filter(|x| {
                        (x.protocol, x.ordering, x.access, x.manager)
                            == (protocol, ordering, access, m)
                    })
                    .collect();
                let join = |f: &dyn Fn(&Cell) -> String| {
                    row.iter()
                        .map(|x| format!("{:>3}", f(x)))
                        .collect::<String>()
                };
                let _ = writeln!(
                    s,
                    "{:<8} {:<6} {:<11} | {:<8} {:<w$} | {:<5} {:<w$} | {:<w$}",
                    label,
                    access.to_string(),
                    m.name(),
                    paper_formula(protocol, access, m),
                    join(&|x| x.messages.to_string()),
                    paper(protocol, access, m, 1).1,
                    join(&|x| x.to_resume.to_string()),
                    join(&|x| x.whole.to_string()),
                );
            }
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "Message counts match the paper in every cell. The paper's critical path is 'to resume'\n\
         for Ivy and for VMP reads, and 'whole fetch' (up to the finish message) for VMP writes:\n\
         VMP resumes a writer one message earlier whenever the manager is not the requester.\n\
         Ivy's write paths of 4 and 5 assume c >= 1; with c = 0 nothing is invalidated.\n\
         VMP-TSO is the default ordering (the paper's 'paper' column is printed beside it for\n\
         comparison): its writes add one inval-ack per copy and, with c >= 1, two messages to\n\
         the path, because the owner hands over only after every copy has acknowledged."
    );
    s
}
