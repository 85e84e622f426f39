//! What `bench vmms` reports: the CSV rows, §5.2's cost and count tables, figures and
//! chart, and §5.3's table of cost increases beside a disturbing VM.

use super::disturber::Disturb;
use super::files::HostDir;
use super::plan::{size_text, Case, Config, HostFs, Plan, Storage, MIB};
use super::runners::Sample;
use crate::plot;
use crate::qemu::{Outcome, Qemu, Standing};
use crate::report::{median_min, ms, Csv, Figure, Table};
use crate::stats::{median, ratio, Summary};

/// The CSV's columns, §5.2 and §5.3 alike.
pub(super) const CSV_COLUMNS: [&str; 19] = [
    "experiment",
    "storage",
    "host_fs",
    "op",
    "path",
    "warm",
    "disturb",
    "rep",
    "bytes",
    "ns",
    "vm_exits",
    "base_vm_exits",
    "interrupts",
    "page_faults",
    "virtio_requests",
    "kernel_copy_bytes",
    "run_doorbells",
    "cpu_model",
    "unavailable",
];

/// Which measurement a CSV row holds: its first nine columns. `case`, `rep` and `bytes`
/// are `None` on the row of a peer that never ran.
pub(super) struct RowKey<'a> {
    pub(super) experiment: &'a str,
    pub(super) storage: Storage,
    pub(super) fs: HostFs,
    pub(super) case: Option<Case>,
    pub(super) disturb: &'a str,
    pub(super) rep: Option<usize>,
    pub(super) bytes: Option<u64>,
}

/// What a row reports beside its key; a peer's failed run has no sample and says why.
pub(super) struct RowData<'a> {
    pub(super) sample: Option<&'a Sample>,
    pub(super) base_exits: Option<f64>,
    pub(super) cpu_model: &'a str,
    pub(super) unavailable: &'a str,
}

pub(super) fn csv_row(csv: &mut Csv, k: &RowKey, d: &RowData) {
    let text = |f: fn(Case) -> &'static str| k.case.map(f).unwrap_or_default().to_string();
    let s = d.sample;
    csv.row([
        k.experiment.to_string(),
        k.storage.name().to_string(),
        k.fs.name().to_string(),
        text(Case::op),
        text(Case::path),
        text(Case::warmth),
        k.disturb.to_string(),
        k.rep.map(|r| r.to_string()).unwrap_or_default(),
        k.bytes.map(|b| b.to_string()).unwrap_or_default(),
        s.map(|s| format!("{:.0}", s.ns)).unwrap_or_default(),
        opt(s.and_then(|s| s.exits)),
        opt(d.base_exits),
        opt(s.and_then(|s| s.interrupts)),
        opt(s.and_then(|s| s.page_faults)),
        opt(s.and_then(|s| s.virtio_requests)),
        opt(s.and_then(|s| s.kernel_copy_bytes)),
        opt(s.and_then(|s| s.doorbells)),
        d.cpu_model.to_string(),
        d.unavailable.to_string(),
    ]);
}

fn opt(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.0}")).unwrap_or_default()
}

/// §5.2's runs, with the questions the tables ask of them.
pub(super) struct Section52<'a> {
    pub(super) plan: &'a Plan,
    pub(super) configs: &'a [Config],
    pub(super) runs: &'a [(usize, usize, Outcome<Sample>)],
}

impl Section52<'_> {
    /// Median exits of the 4 KiB runs, taken out of the per-MB counts.
    fn base_exits(&self, storage: Storage, fs: HostFs) -> Option<f64> {
        let xs: Vec<f64> = self
            .runs
            .iter()
            .filter(|(_, ci, _)| {
                let c = &self.configs[*ci];
                c.base && c.storage == storage && c.fs == fs
            })
            .filter_map(|(_, _, s)| s.measured()?.exits)
            .collect();
        median(&xs)
    }

    fn pick(&self, storage: Storage, fs: HostFs, case: Case) -> Vec<&Sample> {
        self.runs
            .iter()
            .filter(|(_, ci, _)| {
                let c = &self.configs[*ci];
                !c.base && c.storage == storage && c.fs == fs && c.case == case
            })
            .filter_map(|(_, _, s)| s.measured())
            .collect()
    }

    fn time(&self, storage: Storage, fs: HostFs, case: Case) -> Option<Summary> {
        Summary::of(
            &self
                .pick(storage, fs, case)
                .iter()
                .map(|s| s.ns)
                .collect::<Vec<_>>(),
        )
    }

    fn has(&self, storage: Storage, fs: HostFs) -> bool {
        self.configs
            .iter()
            .any(|c| c.storage == storage && c.fs == fs && !c.base)
    }

    /// One row per measured run (the base runs only feed `base_vm_exits`), one per failed
    /// QEMU run, and one for a QEMU that never started.
    pub(super) fn write_csv(&self, csv: &mut Csv, qemu: Option<&Qemu>, peer: &Standing) {
        for (rep, ci, s) in self.runs {
            let c = &self.configs[*ci];
            if c.base {
                continue;
            }
            let cpu_model = match (c.storage, qemu) {
                (Storage::QemuWb, Some(q)) => q.cpu_model(),
                _ => "",
            };
            let (sample, unavailable) = match s {
                Outcome::Measured(s) => (Some(s), ""),
                Outcome::PeerFailed(why) => (None, why.as_str()),
                Outcome::NotMade => continue,
            };
            let key = RowKey {
                experiment: "5.2",
                storage: c.storage,
                fs: c.fs,
                case: Some(c.case),
                disturb: "none",
                rep: Some(*rep),
                bytes: Some(self.plan.extent),
            };
            let base_exits = sample.and_then(|_| self.base_exits(c.storage, c.fs));
            csv_row(
                csv,
                &key,
                &RowData {
                    sample,
                    base_exits,
                    cpu_model,
                    unavailable,
                },
            );
        }
        if let (None, Some(why)) = (qemu, &peer.unavailable) {
            let key = RowKey {
                experiment: "5.2",
                storage: Storage::QemuWb,
                fs: HostFs::Tmpfs,
                case: None,
                disturb: "",
                rep: None,
                bytes: None,
            };
            let data = RowData {
                sample: None,
                base_exits: None,
                cpu_model: "",
                unavailable: why,
            };
            csv_row(csv, &key, &data);
        }
    }

    /// Prints the cost table and the per-MB count table; returns the figures set beside the
    /// paper's and the chart's panels.
    pub(super) fn print(
        &self,
        dirs: &[HostDir],
        peer: &Standing,
    ) -> (Vec<Figure>, Vec<plot::Panel>) {
        let (t, figures) = self.cost_table(dirs);
        println!();
        println!(
            "Cost of moving {} (median / min over {} run(s); ratios of medians); guest page cache \
             {} = {:.2} of the extent (paper: 256 MB RAM / 512 MB file = 0.50)",
            size_text(self.plan.extent),
            self.plan.reps,
            size_text(self.plan.page_cache),
            self.plan.page_cache as f64 / self.plan.extent as f64
        );
        println!("{}", t.render());
        println!(
            "paper 000 §5.2 (512 MB, host page cache on): virtio/VMMS up to 9.0x reading and 10.6x writing;\n\
             mmap warm 8.4-9.0x (read) / 9.8-10.6x (write); the other cases 2.8-3.8x (read) / 1.4-3.4x (write)."
        );
        peer.print();
        let count_fs = HostFs::Disk;
        let c = self.count_table(count_fs);
        println!();
        println!(
            "What each path did per MB moved (host file on {}; QEMU on tmpfs; medians). VM exits are the\n\
             run's exits less a run of a 4 KiB extent, over every pass (a warm run moves the extent twice);\n\
             the guest's counts cover the timed pass. CPL0 copy B/B: bytes the guest kernel copied per byte moved;\n\
             doorbells: virtio queue notifications the VMM saw over the whole run, per MB of every pass.",
            count_fs.name()
        );
        println!("{}", c.render());
        println!("{COUNTS_ON_THIS_MACHINE}");
        (figures, self.panels(dirs))
    }

    /// Costs and ratios per host file and case, and the figures set beside the paper's.
    fn cost_table(&self, dirs: &[HostDir]) -> (Table, Vec<Figure>) {
        let mut t = Table::new(&[
            "host file",
            "case",
            ">vmms ms",
            ">virtio/wb ms",
            ">virtio/none ms",
            ">qemu/wb ms",
            ">wb/vmms",
            ">none/vmms",
            ">qemu/vmms",
            ">paper virtio/vmms (wb)",
        ]);
        let mut figures = Vec::new();
        for d in dirs {
            let mut ahead = Vec::new();
            for case in Case::all() {
                let v = self.time(Storage::Vmms, d.fs, case);
                let wb = self.time(Storage::VirtioWb, d.fs, case);
                let none = self.time(Storage::VirtioNone, d.fs, case);
                let qm = self.time(Storage::QemuWb, d.fs, case);
                let r = |o: Option<Summary>| match (o, v) {
                    (Some(o), Some(v)) => ratio(o.median, v.median),
                    _ => None,
                };
                let cell = |s: Option<Summary>, present: bool| {
                    if present {
                        median_min(s, ms)
                    } else {
                        "-".into()
                    }
                };
                let (lo, hi) = case.paper_ratio();
                t.row([
                    d.fs.name().to_string(),
                    case.to_string(),
                    cell(v, true),
                    cell(wb, true),
                    cell(none, self.has(Storage::VirtioNone, d.fs)),
                    cell(qm, self.has(Storage::QemuWb, d.fs)),
                    times(r(wb)),
                    times(r(none)),
                    times(r(qm)),
                    format!("{lo:.1}-{hi:.1}x"),
                ]);
                for x in [r(wb), r(none)].into_iter().flatten() {
                    ahead.push((case, x));
                }
                if case.mmap && case.warm {
                    let goal = if case.write { 10.6 } else { 9.0 };
                    figures.push(Figure {
                        what: format!("virtio/wb / vmms, {case}, {}", d.fs.name()),
                        ours: times(r(wb)),
                        reference: format!(">= {goal:.1}x"),
                        source: "paper 000 §5.2 (mmap warm, host page cache on)".into(),
                        met: r(wb).map(|x| x >= goal),
                    });
                }
            }
            let worst = ahead
                .iter()
                .min_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal));
            figures.push(Figure {
                what: format!("vmms ahead of virtio in every case, {}", d.fs.name()),
                ours: worst
                    .map(|(c, x)| format!("min {x:.2}x ({c})"))
                    .unwrap_or_else(|| "-".into()),
                reference: "> 1x".into(),
                source: "Musubi goal; paper: 1.4x at least".into(),
                met: worst.map(|(_, x)| *x > 1.0),
            });
        }
        (t, figures)
    }

    /// One panel per case, each on its own scale: the costs span three orders of magnitude.
    fn panels(&self, dirs: &[HostDir]) -> Vec<plot::Panel> {
        let mut panels = Vec::new();
        for case in Case::all() {
            let mut bars = Vec::new();
            for d in dirs {
                for s in [
                    Storage::Vmms,
                    Storage::VirtioWb,
                    Storage::VirtioNone,
                    Storage::QemuWb,
                ] {
                    if let Some(m) = self.time(s, d.fs, case) {
                        let short = match s {
                            Storage::Vmms => "vmms",
                            Storage::VirtioWb => "wb",
                            Storage::VirtioNone => "none",
                            Storage::QemuWb => "qemu",
                        };
                        bars.push(plot::Bar {
                            label: format!("{short}/{}", &d.fs.name()[..1]),
                            value: m.median / 1e6,
                            low: Some(m.min / 1e6),
                        });
                    }
                }
            }
            panels.push(plot::Panel {
                title: case.to_string(),
                unit: "ms".into(),
                bars,
            });
        }
        panels
    }

    /// Counts per MB: what each path costs in the currency §6.1 reasons with (host files on
    /// `count_fs`, QEMU's on tmpfs).
    fn count_table(&self, count_fs: HostFs) -> Table {
        let mut c = Table::new(&[
            "storage",
            "case",
            ">VM exits/MB",
            ">interrupts/MB",
            ">page faults/MB",
            ">virtio req/MB",
            ">CPL0 copy B/B",
            ">doorbells/MB (run)",
        ]);
        let mb = self.plan.extent as f64 / MIB as f64;
        let one = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
        for storage in [
            Storage::Vmms,
            Storage::VirtioWb,
            Storage::VirtioNone,
            Storage::QemuWb,
        ] {
            let fs = if storage == Storage::QemuWb {
                HostFs::Tmpfs
            } else {
                count_fs
            };
            if !self.has(storage, fs) {
                continue;
            }
            let base = self.base_exits(storage, fs);
            for case in Case::all() {
                let ss = self.pick(storage, fs, case);
                if ss.is_empty() {
                    continue;
                }
                let med = |f: &dyn Fn(&Sample) -> Option<f64>| {
                    median(&ss.iter().filter_map(|s| f(s)).collect::<Vec<_>>())
                };
                // Exits cover the whole run: a warm run moves the extent twice.
                let passes = if case.warm { 2.0 } else { 1.0 };
                let exits = med(&|s| Some(((s.exits? - base?) / (passes * mb)).max(0.0)));
                let per = |f: &dyn Fn(&Sample) -> Option<f64>| one(med(&|s| f(s).map(|v| v / mb)));
                c.row([
                    storage.name().to_string(),
                    case.to_string(),
                    one(exits),
                    per(&|s| s.interrupts),
                    per(&|s| s.page_faults),
                    per(&|s| s.virtio_requests),
                    med(&|s| s.kernel_copy_bytes.map(|b| b / self.plan.extent as f64))
                        .map(|v| format!("{v:.2}"))
                        .unwrap_or_else(|| "-".into()),
                    one(med(&|s| Some(s.doorbells? / (passes * mb)))),
                ]);
            }
        }
        c
    }
}

/// A ratio as the cost table prints it.
fn times(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "-".into())
}

/// Why the counts, not the times, carry over to a real KVM host.
const COUNTS_ON_THIS_MACHINE: &str = "\
On this machine guest kernel code is emulated (see DESIGN): every CPL0 copy runs at a few MB/s
and every exit costs about 85 us, so the times above exaggerate the paths with kernel copies
and exits (virtio; VMMS syscall). The counts are what carries over to a real KVM host: VMMS
moves data with no virtio request, no interrupt and, on mmap, no kernel copy at all (§6.1).
Where the counts match, the times cannot differ by the paper's factors: in the system-call
cases both storages copy every byte at CPL0 once (CPL0 copy B/B = 1) and that emulated copy is
most of the time; in the mmap warm reads the warm pass leaves every page mapped in both (the
region itself, or the guest's page cache), so the timed pass is user-mode loads with no fault,
request or copy on either side. The paper's guests were Linux 3.4 with ext2 and a block layer
with request scheduling (§6.1 attributes most of the gap to that); the probe guest has neither.";

/// One repetition of one §5.3 condition: each storage and case measured, and how many
/// whole fills of its disk the disturbing VM finished meanwhile.
pub(super) type Disturbed = (Vec<(Storage, Case, Sample)>, u64);

/// §5.3's runs, with what the table needs to say about them.
pub(super) struct Section53<'a> {
    pub(super) plan: &'a Plan,
    pub(super) fs: HostFs,
    pub(super) conds: &'a [Disturb],
    pub(super) storages: &'a [Storage],
    pub(super) cases: &'a [Case],
    pub(super) runs: &'a [(usize, usize, Disturbed)],
    /// The disturber's cgroup's peak memory use, per cgroup run.
    pub(super) peaks: &'a [Option<u64>],
    /// Why the cgroup condition was left out, if it was.
    pub(super) cgroup_note: Option<String>,
}

impl Section53<'_> {
    pub(super) fn write_csv(&self, csv: &mut Csv) {
        for (rep, ci, (out, _)) in self.runs {
            for (s, c, x) in out {
                let key = RowKey {
                    experiment: "5.3",
                    storage: *s,
                    fs: self.fs,
                    case: Some(*c),
                    disturb: self.conds[*ci].name(),
                    rep: Some(*rep),
                    bytes: Some(self.plan.extent),
                };
                let data = RowData {
                    sample: Some(x),
                    base_exits: None,
                    cpu_model: "",
                    unavailable: "",
                };
                csv_row(csv, &key, &data);
            }
        }
    }

    /// The cost increases beside the disturbing VM, set beside the paper's.
    pub(super) fn text(&self) -> String {
        let med = |d: Disturb, s: Storage, c: Case| -> Option<f64> {
            let xs: Vec<f64> = self
                .runs
                .iter()
                .filter(|(_, ci, _)| self.conds[*ci] == d)
                .flat_map(|(_, _, (out, _))| out.iter())
                .filter(|(s2, c2, _)| *s2 == s && *c2 == c)
                .map(|(_, _, x)| x.ns)
                .collect();
            median(&xs)
        };
        let mut t = Table::new(&[
            "storage",
            "case",
            ">alone ms",
            ">+disturb ms",
            ">increase",
            ">paper",
            ">+cgroup ms",
            ">increase",
            ">paper",
        ]);
        let pct = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:+.0}%", (a / b - 1.0) * 100.0),
            _ => "-".into(),
        };
        let msv = |v: Option<f64>| v.map(ms).unwrap_or_else(|| "-".into());
        for &s in self.storages {
            for &c in self.cases {
                let (a, d, g) = (
                    med(Disturb::Alone, s, c),
                    med(Disturb::Disturbed, s, c),
                    med(Disturb::Cgroup, s, c),
                );
                let (pd, pg) = match (s, c.write) {
                    (Storage::Vmms, false) => ("16-22%", "2-9%"),
                    (Storage::Vmms, true) => ("17-63%", "6-17%"),
                    (_, false) => ("20-25%", "16-31%"),
                    (_, true) => ("7-25%", "7-24%"),
                };
                t.row([
                    s.name().to_string(),
                    c.to_string(),
                    msv(a),
                    msv(d),
                    pct(d, a),
                    pd.to_string(),
                    msv(g),
                    pct(g, a),
                    pg.to_string(),
                ]);
            }
        }
        let fills: u64 = self.runs.iter().map(|(_, _, (_, f))| *f).sum();
        let peak = self
            .peaks
            .iter()
            .flatten()
            .max()
            .map(|p| format!("; cgroup peak usage {} MiB", p / MIB))
            .unwrap_or_default();
        let mut text = String::new();
        text.push_str(&format!(
            "Cost increase with a disturbing VM (median; host files on {}; extent {})\n",
            self.fs.name(),
            size_text(self.plan.extent)
        ));
        text.push_str(&t.render());
        text.push_str(&format!(
            "paper 000 §5.3 (increase over alone): VMMS read 16-22% / write 17-63%, with the cgroup 2-9% / 6-17%;\n\
             virtio read 20-25% / write 7-25%, with the cgroup 16-31% / 7-24%.\n\
             The disturbing VM finished {fills} whole fill(s) of its disk during the measurements{peak}. With 2 cores\n\
             the two VMs also compete for CPU time, which the paper's 4-core host did not have to share."
        ));
        if let Some(n) = &self.cgroup_note {
            text.push_str(&format!("\n{n}"));
        }
        text
    }
}
