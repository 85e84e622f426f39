//! `musubi bench seq`: paper 004's Table 1 — the cost of running sequential programs in
//! one VM against running them natively (V/P), for a CPU-bound program (fib), a system-call
//! loop (getpid), a directory listing and a compilation, each with the same workload code
//! natively and in the probe guest.

use super::driver::{Columns, Outputs, Runs};
use super::guest_run::{in_vm, native, WorkloadRun};
use super::report::Table;
use super::stats::median;
use super::{plot, Harness};
use vmm::config::ExitsMode;

struct Program {
    task: String,
    label: &'static str,
    /// V/P the paper measured (Kaneda et al. 2005, Table 1).
    paper: f64,
    /// Whether native and VM runs must print the same result (getpid's is the pid).
    same_result: bool,
}

fn programs(quick: bool) -> Vec<Program> {
    let (fib, getpid, ls, cc) = if quick {
        (27, 10_000, 2_000, 20)
    } else {
        (32, 100_000, 20_000, 200)
    };
    vec![
        Program {
            task: format!("fib={fib}"),
            label: "fib",
            paper: 0.97,
            same_result: true,
        },
        Program {
            task: format!("getpid={getpid}"),
            label: "getpid",
            paper: 354.0,
            same_result: false,
        },
        Program {
            task: format!("ls-like={ls}"),
            label: "ls",
            paper: 255.0,
            same_result: true,
        },
        Program {
            task: format!("compile-like={cc}"),
            label: "gcc",
            paper: 6.81,
            same_result: true,
        },
    ]
}

pub fn run(h: &Harness, _args: &super::BenchArgs) -> Result<(), String> {
    let ps = programs(h.quick);
    let reps = if h.quick { 1 } else { 3 };
    let configs: Vec<(usize, bool)> = (0..ps.len())
        .flat_map(|i| [(i, false), (i, true)])
        .collect();
    let runs = Runs::measure(
        h,
        configs,
        reps,
        |(i, vm)| format!("{} {}", ps[*i].task, if *vm { "vm" } else { "native" }),
        |_, (i, vm)| {
            if *vm {
                in_vm(&ps[*i].task, ExitsMode::Kernel, None)
            } else {
                native(&ps[*i].task, None)
            }
        },
    )?;
    type Row<'a> = (usize, &'a (usize, bool), &'a WorkloadRun);
    let csv = Columns::new()
        .col("program", |x: &Row| ps[x.1 .0].label.to_string())
        .col("task", |x| ps[x.1 .0].task.clone())
        .col("where", |x| {
            (if x.1 .1 { "vm" } else { "native" }).to_string()
        })
        .col("rep", |x| x.0.to_string())
        .col("ns", |x| {
            x.2.ns().map(|v| format!("{v:.0}")).unwrap_or_default()
        })
        .col("result", |x| x.2.result["result"].to_string())
        .col("total_exits", |x| {
            x.2.total_exits().map(|v| v.to_string()).unwrap_or_default()
        })
        .csv(runs.iter());
    let mut t = Table::new(&[
        "program",
        "task",
        ">P native ms",
        ">V in VM ms",
        ">V/P ours",
        ">V/P paper",
        "same result",
    ]);
    let mut bars = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        let pick = |vm: bool| runs.of(&(i, vm));
        let (pn, pv) = (pick(false), pick(true));
        let tp = median(&pn.iter().filter_map(|r| r.ns()).collect::<Vec<_>>());
        let tv = median(&pv.iter().filter_map(|r| r.ns()).collect::<Vec<_>>());
        let same = !p.same_result
            || pn
                .iter()
                .chain(pv.iter())
                .all(|r| r.result["result"] == pn[0].result["result"]);
        let vp = match (tv, tp) {
            (Some(v), Some(n)) if n > 0.0 => Some(v / n),
            _ => None,
        };
        let ms = |v: Option<f64>| {
            v.map(|v| format!("{:.3}", v / 1e6))
                .unwrap_or_else(|| "n/a".into())
        };
        t.row([
            p.label.to_string(),
            p.task.clone(),
            ms(tp),
            ms(tv),
            vp.map(|v| format!("{v:.2}"))
                .unwrap_or_else(|| "n/a".into()),
            format!("{:.2}", p.paper),
            match (p.same_result, same) {
                (false, _) => "n/a (pid)".to_string(),
                (true, true) => "yes".to_string(),
                (true, false) => "NO".to_string(),
            },
        ]);
        if let Some(v) = vp {
            bars.push(plot::Bar {
                label: p.label.into(),
                value: v,
                low: None,
            });
        }
        if !same {
            return Err(format!(
                "{}: native and VM runs computed different results",
                p.task
            ));
        }
    }
    println!("Sequential programs in one VM vs native (paper 004 Table 1, V/P)");
    println!("{}", t.render());
    println!(
        "The paper's V/P for getpid and ls come from trapping every guest system call to a user-level\n\
         monitor; here user code runs natively and each system call enters the guest kernel, which this\n\
         nested KVM emulates (see DESIGN), so system-call-heavy rows measure that emulation."
    );
    let out = Outputs::new(h);
    let p = out.csv("seq.csv", &csv)?;
    let s = out.bars(
        "seq.svg",
        "V/P by program",
        &[plot::Panel {
            title: "V/P".into(),
            unit: "x".into(),
            bars,
        }],
    )?;
    println!("csv: {}\nplot: {}", p.display(), s.display());
    Ok(())
}
