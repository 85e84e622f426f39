//! `musubi bench composite`: paper 002's question — how much does handling hot traps in
//! the kernel part save over a user-level-only VMM? Exit-heavy probe-guest workloads run
//! natively (where that has a meaning), with `--exits user` and with `--exits kernel`, in
//! one interleaved run; we report time ratios beside the paper's Table 1 and, since this
//! machine's exits are slow and noisy, exits per operation and VMM time per exit. Then the
//! Table 1 workload itself, a make-like build ([`make`]), natively and on both exit paths.

mod make;

use super::driver::{Columns, Outputs, Runs, Verdicts};
use super::guest_run::{in_vm, native, VmFigure, WorkloadRun, DOORBELL_EXITS, IRQ_IRQFD, IRQ_USER};
use super::report::{Csv, Figure, Table};
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

impl Config {
    fn name(&self, ws: &[Workload]) -> String {
        format!(
            "{} {}{}",
            ws[self.w].task,
            self.at.name(),
            if self.base { " (base)" } else { "" }
        )
    }
}

pub fn run(h: &Harness, _args: &super::BenchArgs) -> Result<(), String> {
    let ws = workloads(h.quick);
    let reps = if h.quick { 1 } else { 3 };
    let dir = tempfile::tempdir().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
    let disk = dir.path().join("composite-disk.img");
    std::fs::write(&disk, vec![0x5au8; 4 << 20]).map_err(|e| format!("{}: {e}", disk.display()))?;
    let runs = Runs::measure(
        h,
        plan(&ws),
        reps,
        |c| c.name(&ws),
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
    let mut csv = columns(&ws).csv(runs.iter());
    let m = Measures {
        runs: &runs,
        ws: &ws,
    };
    let (t, panels, mut verdicts) = m.table();
    let net = network_row(h, &mut csv, &mut verdicts.0);
    println!("Composite hypervisor (paper 002): exit-heavy workloads, native / user-level exits / kernel exits");
    println!("{}", t.render());
    println!("{net}");
    println!(
        "paper 002 Table 1 (make of GNU awk): native {PAPER_NATIVE_S} s, user-level only {PAPER_USER_S} s ({:.2}x), composite {PAPER_COMPOSITE_S} s ({:.2}x); user/composite {:.2}x",
        PAPER_USER_S / PAPER_NATIVE_S,
        PAPER_COMPOSITE_S / PAPER_NATIVE_S,
        PAPER_USER_S / PAPER_COMPOSITE_S
    );
    println!("{}", verdicts.table());
    println!(
        "On this machine every exit crosses a nested KVM (about 85 us each, the same for any VMM), so times\n\
         are dominated by exits the kernel path cannot remove (port I/O, interrupt acknowledgement);\n\
         exits per operation and VMM time per exit are the figures to compare across machines.\n\
         exits/op subtracts a run of the same task with a count of 1 (boot and reporting)."
    );
    let out = Outputs::new(h);
    let p = out.csv("composite.csv", &csv)?;
    let s = out.bars("composite.svg", "task time by exit path (median)", &panels)?;
    println!("csv: {}\nplot: {}", p.display(), s.display());
    // One exit's round trip on each path: a port write from guest user mode that no device
    // claims, so every one goes to the VMM and back.
    let ping = ws.iter().position(|w| w.task == "port-ping");
    let exit_ns = |mode: ExitsMode| {
        let i = ping?;
        Some(m.time(i, Where::Vm(mode))? / ws[i].count as f64)
    };
    make::run(h, &exit_ns)
}

/// Every workload natively (where it runs there) and on both exit paths, each path also
/// with a count of 1.
fn plan(ws: &[Workload]) -> Vec<Config> {
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
            for base in [false, true] {
                configs.push(Config {
                    w: i,
                    at: Where::Vm(mode),
                    base,
                });
            }
        }
    }
    configs
}

/// `composite.csv`'s columns, one row per run.
fn columns<'c>(ws: &'c [Workload]) -> Columns<'c, (usize, &'c Config, &'c WorkloadRun)> {
    type R<'a> = (usize, &'a Config, &'a WorkloadRun);
    let metric = |figure: VmFigure| {
        move |x: &R| {
            x.2.metrics
                .as_ref()
                .and_then(figure)
                .map(|v| v.to_string())
                .unwrap_or_default()
        }
    };
    Columns::new()
        .col("workload", move |x: &R| ws[x.1.w].task.to_string())
        .col("count", move |x| {
            (if x.1.base { 1 } else { ws[x.1.w].count }).to_string()
        })
        .col("where", |x| x.1.at.name().to_string())
        .col("base", |x| x.1.base.to_string())
        .col("rep", |x| x.0.to_string())
        .col("task_ns", |x| {
            x.2.ns().map(|v| format!("{v:.0}")).unwrap_or_default()
        })
        .col("total_exits", |x| {
            x.2.total_exits().map(|v| v.to_string()).unwrap_or_default()
        })
        .col("doorbell_exits", metric(DOORBELL_EXITS))
        .col("vmm_ns_per_exit", |x| {
            x.2.vmm_ns_per_exit()
                .map(|v| format!("{v:.0}"))
                .unwrap_or_default()
        })
        .col("irq_user", metric(IRQ_USER))
        .col("irq_irqfd", metric(IRQ_IRQFD))
}

/// The runs' medians per workload and place, and per operation.
struct Measures<'a> {
    runs: &'a Runs<Config, WorkloadRun>,
    ws: &'a [Workload],
}

/// The two exit paths.
const U: Where = Where::Vm(ExitsMode::User);
const K: Where = Where::Vm(ExitsMode::Kernel);

fn f2(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "n/a".into())
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

impl Measures<'_> {
    fn med(
        &self,
        w: usize,
        at: Where,
        base: bool,
        f: &dyn Fn(&WorkloadRun) -> Option<f64>,
    ) -> Option<f64> {
        let xs: Vec<f64> = self
            .runs
            .iter()
            .filter(|(_, c, _)| c.w == w && c.at == at && c.base == base)
            .filter_map(|(_, _, r)| f(r))
            .collect();
        median(&xs)
    }

    fn time(&self, w: usize, at: Where) -> Option<f64> {
        self.med(w, at, false, &|r| r.ns())
    }

    /// Exits the N operations cost beyond a run of one operation, per operation.
    fn per_op(&self, w: usize, at: Where, f: &dyn Fn(&WorkloadRun) -> Option<f64>) -> Option<f64> {
        let n = self.med(w, at, false, f)?;
        let b = self.med(w, at, true, f)?;
        Some((n - b) / (self.ws[w].count.saturating_sub(1).max(1)) as f64)
    }

    /// The table, a chart panel per workload, and the small reads' verdicts.
    fn table(&self) -> (Table, Vec<plot::Panel>, Verdicts) {
        let exits = |r: &WorkloadRun| r.total_exits().map(|v| v as f64);
        let doorbells = |r: &WorkloadRun| {
            r.metrics
                .as_ref()
                .and_then(DOORBELL_EXITS)
                .map(|v| v as f64)
        };
        let injections =
            |r: &WorkloadRun| Some(r.metrics.as_ref().and_then(IRQ_USER).unwrap_or(0) as f64);
        let vmm_ns = |w, at| self.med(w, at, false, &|r| r.vmm_ns_per_exit());
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
        let mut figures = Verdicts::new();
        for (i, w) in self.ws.iter().enumerate() {
            let tn = if w.native {
                self.time(i, Where::Native)
            } else {
                None
            };
            let (tu, tk) = (self.time(i, U), self.time(i, K));
            let ms = |v: Option<f64>| {
                v.map(|v| format!("{:.2}", v / 1e6))
                    .unwrap_or_else(|| "n/a".into())
            };
            let (dbu, dbk) = (self.per_op(i, U, &doorbells), self.per_op(i, K, &doorbells));
            t.row([
                w.task.to_string(),
                w.count.to_string(),
                ms(tn),
                ms(tu),
                ms(tk),
                f2(ratio(tu, tn)),
                f2(ratio(tk, tn)),
                f2(ratio(tu, tk)),
                f2(self.per_op(i, U, &exits)),
                f2(self.per_op(i, K, &exits)),
                f2(dbu),
                f2(dbk),
                f2(self.per_op(i, U, &injections)),
                f2(vmm_ns(i, U).map(|v| v / 1e3)),
                f2(vmm_ns(i, K).map(|v| v / 1e3)),
            ]);
            panels.push(panel(w.task, tn, tu, tk));
            if w.task == "blk-small-reads" {
                small_reads_verdicts(&mut figures, dbk, ratio(tu, tk));
            }
        }
        (t, panels, figures)
    }
}

/// One workload's times, native, user and kernel.
fn panel(task: &str, tn: Option<f64>, tu: Option<f64>, tk: Option<f64>) -> plot::Panel {
    let bar = |label: &str, v: Option<f64>| {
        v.map(|v| plot::Bar {
            label: label.into(),
            value: v / 1e6,
            low: None,
        })
    };
    plot::Panel {
        title: task.into(),
        unit: "ms".into(),
        bars: [bar("native", tn), bar("user", tu), bar("kernel", tk)]
            .into_iter()
            .flatten()
            .collect(),
    }
}

/// The kernel path's doorbell goal and the user/kernel ratio beside the paper's, judged
/// on the small reads (`dbk`: doorbell exits per request on the kernel path).
fn small_reads_verdicts(v: &mut Verdicts, dbk: Option<f64>, user_kernel: Option<f64>) {
    v.push(Figure {
        what: "doorbell exits per request, kernel path".into(),
        ours: f2(dbk),
        reference: "0".into(),
        source: "issue goal: the kernel path removes every doorbell exit".into(),
        met: dbk.map(|v| v.abs() < 0.01),
    });
    v.push(Figure {
        what: "user / kernel time, small reads".into(),
        ours: format!("{}x", f2(user_kernel)),
        reference: format!(">= {:.2}x", PAPER_USER_S / PAPER_COMPOSITE_S),
        source: "paper 002 Table 1 (20.4 s / 15.5 s)".into(),
        met: user_kernel.map(|r| r >= PAPER_USER_S / PAPER_COMPOSITE_S),
    });
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
