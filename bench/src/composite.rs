//! `musubi bench composite`: paper 002's question — how much does handling hot traps in
//! the kernel part save over a user-level-only VMM? Exit-heavy probe-guest workloads run
//! natively (where that has a meaning), with `--exits user` and with `--exits kernel`, in
//! one interleaved run; we report time ratios beside the paper's Table 1 and, since this
//! machine's exits are slow and noisy, exits per operation and VMM time per exit. Then the
//! Table 1 workload itself, a make-like build ([`make`]), natively and on both exit paths.

mod make;

use super::guest_run::{in_vm, native, WorkloadRun};
use super::report::{figures_table, Csv, Figure, Table};
use super::stats::median;
use super::{plot, Harness};
use vmm::config::ExitsMode;

/// Paper 002, Table 1: building GNU awk natively, on the user-level-only VMM and on the
/// composite VMM (seconds).
const PAPER_NATIVE_S: f64 = 13.0;
const PAPER_USER_S: f64 = 20.4;
const PAPER_COMPOSITE_S: f64 = 15.5;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Where {
    Native,
    Vm(ExitsMode),
}

impl Where {
    fn name(self) -> &'static str {
        match self {
            Where::Native => "native",
            Where::Vm(ExitsMode::User) => "user",
            Where::Vm(ExitsMode::Kernel) => "kernel",
        }
    }
}

struct Workload {
    task: &'static str,
    count: u64,
    /// Whether the same work means anything outside a VM.
    native: bool,
    disk: bool,
}

fn workloads(quick: bool) -> Vec<Workload> {
    let k = if quick { 10 } else { 1 };
    vec![
        Workload {
            task: "blk-small-reads",
            count: 1000 / k,
            native: true,
            disk: true,
        },
        Workload {
            task: "serial-out",
            count: 2000 / k,
            native: false,
            disk: false,
        },
        Workload {
            task: "port-ping",
            count: 20000 / k,
            native: false,
            disk: false,
        },
        Workload {
            task: "page-touch",
            count: 4000 / k,
            native: true,
            disk: false,
        },
    ]
}

struct Config {
    w: usize,
    at: Where,
    /// The same task with a count of 1, to subtract boot and reporting from the exits.
    base: bool,
}

pub fn run(h: &Harness, _args: &super::BenchArgs) -> Result<(), String> {
    let ws = workloads(h.quick);
    let reps = if h.quick { 1 } else { 3 };
    let dir = tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
    let disk = dir.path().join("composite-disk.img");
    std::fs::write(&disk, vec![0x5au8; 4 << 20]).map_err(|e| format!("{}: {e}", disk.display()))?;

    let mut configs = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        if w.native {
            configs.push(Config {
                w: i,
                at: Where::Native,
                base: false,
            });
        }
        for mode in [ExitsMode::User, ExitsMode::Kernel] {
            configs.push(Config {
                w: i,
                at: Where::Vm(mode),
                base: false,
            });
            configs.push(Config {
                w: i,
                at: Where::Vm(mode),
                base: true,
            });
        }
    }
    let runs = h.run_schedule(
        &configs,
        reps,
        |c| {
            format!(
                "{} {}{}",
                ws[c.w].task,
                c.at.name(),
                if c.base { " (base)" } else { "" }
            )
        },
        |_, c| {
            let w = &ws[c.w];
            let count = if c.base { 1 } else { w.count };
            let task = format!("{}={count}", w.task);
            let d = w.disk.then_some(disk.as_path());
            match c.at {
                Where::Native => native(&task, d),
                Where::Vm(mode) => in_vm(&task, mode, d),
            }
        },
    )?;

    let mut csv = Csv::new(&[
        "workload",
        "count",
        "where",
        "base",
        "rep",
        "task_ns",
        "total_exits",
        "doorbell_exits",
        "vmm_ns_per_exit",
        "irq_user",
        "irq_irqfd",
    ]);
    for (rep, ci, r) in &runs {
        let c = &configs[*ci];
        let w = &ws[c.w];
        csv.row([
            w.task.to_string(),
            (if c.base { 1 } else { w.count }).to_string(),
            c.at.name().to_string(),
            c.base.to_string(),
            rep.to_string(),
            r.ns().map(|v| format!("{v:.0}")).unwrap_or_default(),
            r.total_exits().map(|v| v.to_string()).unwrap_or_default(),
            r.metrics["notifications"]["mmio_exit"]
                .as_u64()
                .map(|v| v.to_string())
                .unwrap_or_default(),
            r.vmm_ns_per_exit()
                .map(|v| format!("{v:.0}"))
                .unwrap_or_default(),
            r.metrics["interrupts"]["user"]
                .as_u64()
                .map(|v| v.to_string())
                .unwrap_or_default(),
            r.metrics["interrupts"]["irqfd"]
                .as_u64()
                .map(|v| v.to_string())
                .unwrap_or_default(),
        ]);
    }

    let pick = |w: usize, at: Where, base: bool| -> Vec<&WorkloadRun> {
        runs.iter()
            .filter(|(_, ci, _)| {
                let c = &configs[*ci];
                c.w == w && c.at == at && c.base == base
            })
            .map(|(_, _, r)| r)
            .collect()
    };
    let med = |xs: Vec<f64>| median(&xs);
    let time = |w, at| med(pick(w, at, false).iter().filter_map(|r| r.ns()).collect());
    // Exits the N operations cost beyond a run of one operation, per operation.
    let per_op = |w: usize, at: Where, f: &dyn Fn(&WorkloadRun) -> Option<f64>| -> Option<f64> {
        let n = med(pick(w, at, false).iter().filter_map(|r| f(r)).collect())?;
        let b = med(pick(w, at, true).iter().filter_map(|r| f(r)).collect())?;
        Some((n - b) / (ws[w].count.saturating_sub(1).max(1)) as f64)
    };
    let exits = |r: &WorkloadRun| r.total_exits().map(|v| v as f64);
    let doorbells = |r: &WorkloadRun| r.metrics["notifications"]["mmio_exit"].as_f64();
    let injections =
        |r: &WorkloadRun| Some(r.metrics["interrupts"]["user"].as_f64().unwrap_or(0.0));
    let vmm_ns = |w, at| {
        med(pick(w, at, false)
            .iter()
            .filter_map(|r| r.vmm_ns_per_exit())
            .collect())
    };

    let (u, k) = (Where::Vm(ExitsMode::User), Where::Vm(ExitsMode::Kernel));
    let f2 = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "n/a".into());
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let mut t = Table::new(&[
        "workload",
        ">N",
        ">native ms",
        ">user ms",
        ">kernel ms",
        ">user/native",
        ">kernel/native",
        ">user/kernel",
        ">exits/op u",
        ">exits/op k",
        ">doorbell exits/op u",
        ">k",
        ">user IRQ injections/op",
        ">VMM us/exit u",
        ">k",
    ]);
    let mut panels = Vec::new();
    let mut figures = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        let tn = if w.native {
            time(i, Where::Native)
        } else {
            None
        };
        let (tu, tk) = (time(i, u), time(i, k));
        let ms = |v: Option<f64>| {
            v.map(|v| format!("{:.2}", v / 1e6))
                .unwrap_or_else(|| "n/a".into())
        };
        let (dbu, dbk) = (per_op(i, u, &doorbells), per_op(i, k, &doorbells));
        t.row([
            w.task.to_string(),
            w.count.to_string(),
            ms(tn),
            ms(tu),
            ms(tk),
            f2(ratio(tu, tn)),
            f2(ratio(tk, tn)),
            f2(ratio(tu, tk)),
            f2(per_op(i, u, &exits)),
            f2(per_op(i, k, &exits)),
            f2(dbu),
            f2(dbk),
            f2(per_op(i, u, &injections)),
            f2(vmm_ns(i, u).map(|v| v / 1e3)),
            f2(vmm_ns(i, k).map(|v| v / 1e3)),
        ]);
        let bar = |label: &str, v: Option<f64>| {
            v.map(|v| plot::Bar {
                label: label.into(),
                value: v / 1e6,
                low: None,
            })
        };
        panels.push(plot::Panel {
            title: w.task.into(),
            unit: "ms".into(),
            bars: [bar("native", tn), bar("user", tu), bar("kernel", tk)]
                .into_iter()
                .flatten()
                .collect(),
        });
        if w.task == "blk-small-reads" {
            figures.push(Figure {
                what: "doorbell exits per request, kernel path".into(),
                ours: f2(dbk),
                reference: "0".into(),
                source: "issue goal: the kernel path removes every doorbell exit".into(),
                met: dbk.map(|v| v.abs() < 0.01),
            });
            figures.push(Figure {
                what: "user / kernel time, small reads".into(),
                ours: format!("{}x", f2(ratio(tu, tk))),
                reference: format!(">= {:.2}x", PAPER_USER_S / PAPER_COMPOSITE_S),
                source: "paper 002 Table 1 (20.4 s / 15.5 s)".into(),
                met: ratio(tu, tk).map(|r| r >= PAPER_USER_S / PAPER_COMPOSITE_S),
            });
        }
    }
    let net = network_row(h, &mut csv, &mut figures);
    println!("Composite hypervisor (paper 002): exit-heavy workloads, native / user-level exits / kernel exits");
    println!("{}", t.render());
    println!("{net}");
    println!(
        "paper 002 Table 1 (make of GNU awk): native {PAPER_NATIVE_S} s, user-level only {PAPER_USER_S} s ({:.2}x), composite {PAPER_COMPOSITE_S} s ({:.2}x); user/composite {:.2}x",
        PAPER_USER_S / PAPER_NATIVE_S,
        PAPER_COMPOSITE_S / PAPER_NATIVE_S,
        PAPER_USER_S / PAPER_COMPOSITE_S
    );
    println!("{}", figures_table(&figures));
    println!(
        "On this machine every exit crosses a nested KVM (about 85 us each, the same for any VMM), so times\n\
         are dominated by exits the kernel path cannot remove (port I/O, interrupt acknowledgement);\n\
         exits per operation and VMM time per exit are the figures to compare across machines.\n\
         exits/op subtracts a run of the same task with a count of 1 (boot and reporting)."
    );
    let p = h.write_csv("composite.csv", &csv)?;
    let s = h.write_chart("composite.svg", "task time by exit path (median)", &panels)?;
    println!("csv: {}\nplot: {}", p.display(), s.display());
    // One exit's round trip on each path: a port write from guest user mode that no device
    // claims, so every one goes to the VMM and back.
    let ping = ws.iter().position(|w| w.task == "port-ping");
    let exit_ns = |mode: ExitsMode| {
        let i = ping?;
        Some(time(i, Where::Vm(mode))? / ws[i].count as f64)
    };
    make::run(h, &exit_ns)
}

/// The network device asked paper 002's question: the probe's UDP request/response over a
/// TAP on both exit paths (`bench net`'s runs). Its runs go into `csv` as workload
/// `udp-echo`, its verdict into `figures`; returns the table to print, or why it is missing.
fn network_row(h: &Harness, csv: &mut Csv, figures: &mut Vec<Figure>) -> String {
    let runs = match super::net::exit_paths(h) {
        Ok(r) => r,
        Err(e) => {
            figures.push(Figure {
                what: "doorbell exits per packet, kernel path, udp-echo".into(),
                ours: "n/a".into(),
                reference: "0".into(),
                source: format!("not measured: {e}"),
                met: None,
            });
            return format!("network row (udp-echo over a TAP): not measured: {e}");
        }
    };
    let mut reps = [0usize; 2];
    for r in &runs {
        let k = usize::from(r.exits == "user");
        csv.row([
            "udp-echo".to_string(),
            r.rounds.to_string(),
            r.exits.to_string(),
            "false".into(),
            reps[k].to_string(),
            format!("{:.0}", r.rounds as f64 / r.rate_per_s * 1e9),
            format!("{:.0}", r.exits_total),
            format!("{:.0}", r.doorbell_exits),
            String::new(),
            String::new(),
            String::new(),
        ]);
        reps[k] += 1;
    }
    let of = |path: &str, f: &dyn Fn(&super::net::PathRun) -> f64| {
        median(
            &runs
                .iter()
                .filter(|r| r.exits == path)
                .map(f)
                .collect::<Vec<_>>(),
        )
    };
    let per_request = |p| of(p, &|r| 1e6 / r.rate_per_s);
    let doorbells = |p| of(p, &|r| r.doorbell_exits / r.packets.max(1.0));
    let exits = |p| of(p, &|r| r.exits_total / r.packets.max(1.0));
    let f2 = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "n/a".into());
    let mut t = Table::new(&[
        "path",
        ">us per request",
        ">p50 us",
        ">exits/packet",
        ">doorbell exits/packet",
    ]);
    for p in ["user", "kernel"] {
        t.row([
            p.to_string(),
            f2(per_request(p)),
            f2(of(p, &|r| r.p50_us)),
            f2(exits(p)),
            f2(doorbells(p)),
        ]);
    }
    let dbk = doorbells("kernel");
    figures.push(Figure {
        what: "doorbell exits per packet, kernel path, udp-echo".into(),
        ours: f2(dbk),
        reference: "0".into(),
        source: "issue goal: no doorbell exit per packet on the kernel path".into(),
        met: dbk.map(|v| v.abs() < 0.01),
    });
    let ratio = match (per_request("user"), per_request("kernel")) {
        (Some(u), Some(k)) if k > 0.0 => format!("{:.2}x", u / k),
        _ => "n/a".into(),
    };
    format!(
        "Network (udp-echo over a TAP, 64-byte request/response; exits counted over the boot):\n{}\nuser / kernel time per request: {ratio}",
        t.render()
    )
}
