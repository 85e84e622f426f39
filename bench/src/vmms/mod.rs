//! `musubi bench vmms`: paper 000's §5.2 and §5.3, run in order. The probe guest moves a
//! file-sized extent through the paper's four access paths (read/write × system calls/mmap,
//! each warm and cold) on storage as memory (`--pmem`, advertised by E820) and on virtio-blk
//! with the host page cache on (`cache=writeback`) and off (`cache=none`), with the host file
//! on tmpfs (the paper's RAM disk) and on the regular file system. Then the same with a second
//! VM writing a large disk at the same time, with and without a memory cgroup on it.
//!
//! Times on this machine are distorted (guest CPL0 code is emulated, so every kernel copy
//! crawls), so beside each time we print what the guest and the VMM counted per MB moved:
//! VM exits, interrupts, page faults, virtio requests and bytes the guest kernel copied. Those
//! counts are what §6.1 reasons with, and they do not depend on the machine.
//!
//! - [`plan`]: the storages, file systems, cases, sizes and the schedule.
//! - [`files`]: the host directories and backing files.
//! - [`runners`]: one configuration run under Musubi or QEMU.
//! - [`disturber`]: §5.3's disturbing VM and its cgroup.
//! - [`report`]: the CSV, tables, figures and chart.

mod disturber;
mod files;
mod plan;
mod report;
mod runners;

use super::driver::{Runs, Verdicts};
use super::qemu::{self, Outcome, Peer, Standing};
use super::report::Csv;
use super::{BenchArgs, Harness};
use disturber::{Disturb, DisturbCgroup, Disturber};
use files::{make_file, HostDir};
use plan::{size_text, Case, HostFs, Plan, Storage, MIB, PAPER_EXTENT};
use report::{Disturbed, Section52, Section53, CSV_COLUMNS};
use runners::{musubi_run, qemu_run};
use std::sync::Arc;
use std::time::Instant;

pub fn run(h: &Harness, args: &BenchArgs) -> Result<(), String> {
    let plan = Plan::new(h, args)?;
    let started = Instant::now();
    println!(
        "VMMS (paper 000 §5.2): {} extent (paper: {PAPER_EXTENT}), {} repetition(s), guest RAM {} MiB, \
         guest page cache {} (half the extent, as the paper's 256 MB guest reading 512 MB)",
        size_text(plan.extent),
        plan.reps,
        plan.memory / MIB,
        size_text(plan.page_cache)
    );
    let dirs = [HostDir::new(HostFs::Tmpfs)?, HostDir::new(HostFs::Disk)?];
    for d in &dirs {
        println!(
            "  host files on {}: {}{}",
            d.fs.name(),
            d.dir.path().display(),
            if d.direct {
                ""
            } else {
                " (O_DIRECT refused here: virtio/none is skipped on this file system)"
            }
        );
    }
    let mut peer = Standing::default();
    let qemu = match qemu::peer(args, &["microvm,acpi=off"])? {
        Peer::Ready(q) => Some(q),
        Peer::Skipped(why) => {
            println!("  QEMU: {why}; no side-by-side runs");
            None
        }
        Peer::Unavailable(why) => {
            peer.unavailable = Some(why);
            None
        }
    };
    if qemu.is_some() {
        println!(
            "  QEMU: the read cases with virtio-blk (microvm, acpi=off, modern virtio-mmio, cache=writeback) on tmpfs. QEMU has no\n  \
             file-backed E820 type-12 region for a PVH guest, so VMMS is compared with QEMU's virtio-blk."
        );
    }

    let configs = plan::schedule(&dirs, qemu.is_some());
    let dir_of = |fs: HostFs| dirs.iter().find(|d| d.fs == fs).expect("both dirs exist");
    for (i, c) in configs.iter().enumerate() {
        let first = !configs[..i]
            .iter()
            .any(|o| o.storage == c.storage && o.fs == c.fs);
        if first {
            make_file(&dir_of(c.fs).file(c.storage), plan.file_len)?;
        }
    }

    // A failed QEMU run is reported and the rest goes on: QEMU is a comparison, not the subject.
    let runs = Runs::measure(
        h,
        configs,
        plan.reps,
        |c| c.name(),
        |rep, c| {
            let file = dir_of(c.fs).file(c.storage);
            let task = c.task(&plan);
            match (c.storage, &qemu) {
                (Storage::QemuWb, Some(q)) => Ok(peer
                    .run(&format!("{} run {}", c.name(), rep + 1), || {
                        qemu_run(q, &plan, &file, &task)
                    })),
                _ => musubi_run(&plan, c.storage, &file, &task).map(Outcome::Measured),
            }
        },
    )?;

    let mut csv = Csv::new(&CSV_COLUMNS);
    let s52 = Section52 {
        plan: &plan,
        configs: &runs.configs,
        runs: &runs.runs,
    };
    s52.write_csv(&mut csv, qemu.as_ref(), &peer);
    let (figures, panels) = s52.print(&dirs, &peer);

    let disturb = disturbance(h, &plan, &dirs[1], &mut csv)?;

    println!();
    println!("{}", Verdicts(figures).table());
    println!("{disturb}");
    h.write_results(
        "vmms",
        &csv,
        "VMMS vs virtio-blk: cost (median ms; /t tmpfs, /d disk)",
        &panels,
    )?;
    println!("elapsed: {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// §5.3: the paper's measurement again (VMMS and virtio/writeback, read and write, both
/// paths, warm) alone, beside a VM writing a large disk, and with that VM in a memory
/// cgroup. Host files on the regular file system, where the host page cache is shared.
/// Writes its CSV rows and returns its report.
fn disturbance(h: &Harness, plan: &Plan, dir: &HostDir, csv: &mut Csv) -> Result<String, String> {
    let big = dir.dir.path().join("disturb.img");
    // A new file for every disturbed run: cgroup v1 charges a cached page to the group that
    // first read or wrote it, so pages left cached by an earlier run outside the group would
    // never count against its limit. Unlinking the old file drops its pages.
    let fresh_disk = || -> Result<(), String> {
        let _ = std::fs::remove_file(&big);
        let f = std::fs::File::create(&big).map_err(|e| format!("{}: {e}", big.display()))?;
        f.set_len(plan.disturb_bytes)
            .map_err(|e| format!("{}: {e}", big.display()))
    };
    let mut conds = vec![Disturb::Alone, Disturb::Disturbed];
    let cgroup_note = match DisturbCgroup::create(plan.disturb_limit) {
        Ok(g) => {
            drop(g);
            conds.push(Disturb::Cgroup);
            None
        }
        Err(e) => Some(format!(
            "the cgroup condition is skipped: cannot make a memory cgroup ({e}); run as root"
        )),
    };
    let storages = [Storage::Vmms, Storage::VirtioWb];
    let cases: Vec<Case> = Case::all().into_iter().filter(|c| c.warm).collect();
    println!();
    println!(
        "Page-cache interference (paper 000 §5.3): a second VM fills a {} virtio-blk disk (cache=writeback)\n\
         over and over while the measured VM runs the warm cases; cgroup: the disturber in a {} memory cgroup.",
        size_text(plan.disturb_bytes),
        size_text(plan.disturb_limit)
    );
    if let Some(n) = &cgroup_note {
        println!("  {n}");
    }
    let mut peaks = Vec::new();
    let runs = Runs::measure(
        h,
        conds,
        plan.reps,
        |d| format!("§5.3 {}", d.name()),
        |_, d| -> Result<Disturbed, String> {
            let group = match d {
                Disturb::Cgroup => Some(Arc::new(DisturbCgroup::create(plan.disturb_limit)?)),
                _ => None,
            };
            let disturber = match d {
                Disturb::Alone => None,
                _ => {
                    fresh_disk()?;
                    Some(Disturber::start(big.clone(), group.clone())?)
                }
            };
            let mut out = Vec::new();
            for &s in &storages {
                for &c in &cases {
                    let task = c.task(s, plan.extent);
                    out.push((s, c, musubi_run(plan, s, &dir.file(s), &task)?));
                }
            }
            let fills = match disturber {
                Some(x) => x.finish()?,
                None => 0,
            };
            if let Some(g) = &group {
                peaks.push(g.peak());
            }
            Ok((out, fills))
        },
    )?;
    let s53 = Section53 {
        plan,
        fs: dir.fs,
        conds: &runs.configs,
        storages: &storages,
        cases: &cases,
        runs: &runs.runs,
        peaks: &peaks,
        cgroup_note,
    };
    s53.write_csv(csv);
    Ok(s53.text())
}
