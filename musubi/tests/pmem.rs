//! Storage as memory (`--pmem`) through the `musubi` binary.
//!
//! Most cases boot a hand-assembled PVH guest: 32-bit code with paging off, so it stores
//! straight to the region's guest-physical address (a 32 MiB VM puts the first region at
//! 32 MiB). That tests the VMM's side alone: placement, the memory slot, the shared mapping
//! and its durability when the VM ends cleanly, crashes, or is killed. The host file is then
//! compared byte for byte.

mod common;
use common::*;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use vmm::testing::{pvh_elf, Code};

const MIB: u64 = 1 << 20;
/// Where the first region of a 32 MiB VM lands.
const REGION0: u32 = 32 << 20;

/// What the host file holds before the guest runs: a pattern that differs from the guest's.
fn pre(i: u64) -> u8 {
    (i * 13 + 5) as u8
}

fn region_file(dir: &Path, name: &str, bytes: u64) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, (0..bytes).map(pre).collect::<Vec<u8>>()).unwrap();
    p
}

fn kernel_file(dir: &Path, code: Code) -> PathBuf {
    let p = dir.join("tiny.elf");
    std::fs::write(&p, pvh_elf(&code.0)).unwrap();
    p
}

/// `pre` with the stores of `fill(base_offset, count, stride, seed)` applied.
fn expect_fill(data: &mut [u8], offset: u64, count: u64, stride: u64, seed: u8) {
    for i in 0..count {
        data[(offset + i * stride) as usize] = (i * 7).wrapping_add(u64::from(seed)) as u8;
    }
}

fn original(bytes: u64) -> Vec<u8> {
    (0..bytes).map(pre).collect()
}

fn assert_same(path: &Path, want: &[u8]) {
    let got = std::fs::read(path).unwrap();
    assert_eq!(got.len(), want.len(), "{} changed length", path.display());
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{}: byte {i:#x} is {:#04x}, expected {:#04x}",
            path.display(),
            got[i],
            want[i]
        );
    }
}

/// The writes every durability case makes: a dense first page, one byte in every page, and
/// the region's last byte.
fn writes(code: Code, base: u32, size: u32, seed: u8) -> Code {
    code.fill(base, 256, 1, seed)
        .fill(base + 4096, size / 4096 - 1, 4096, seed.wrapping_add(1))
        .fill(base + size - 1, 1, 1, seed.wrapping_add(2))
}

fn expected_after_writes(size: u64, seed: u8) -> Vec<u8> {
    let mut want = original(size);
    expect_fill(&mut want, 0, 256, 1, seed);
    expect_fill(&mut want, 4096, size / 4096 - 1, 4096, seed.wrapping_add(1));
    expect_fill(&mut want, size - 1, 1, 1, seed.wrapping_add(2));
    want
}

fn run_tiny(kernel: &Path, pmem: &[String]) -> Run {
    let mut args = vec![
        "run".to_string(),
        "--kernel".into(),
        kernel.display().to_string(),
        "--memory".into(),
        "32M".into(),
        "--timeout".into(),
        "60".into(),
    ];
    for p in pmem {
        args.push("--pmem".into());
        args.push(p.clone());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_with_limit(&args, Duration::from_secs(120))
}

/// One region file in its own directory, holding `pre` before the guest runs.
struct Region {
    dir: tempfile::TempDir,
    path: PathBuf,
    size: u64,
}

impl Region {
    fn new(size: u64) -> Region {
        let dir = tempfile::tempdir().unwrap();
        let path = region_file(dir.path(), "p.img", size);
        Region { dir, path, size }
    }

    fn spec(&self) -> String {
        format!("file={}", self.path.display())
    }

    /// A tiny guest that runs `before`, makes the durability `writes` with `seed` over the
    /// whole region (the first one of a 32 MiB VM), then runs `after`.
    fn kernel(&self, before: Code, seed: u8, after: impl FnOnce(Code) -> Code) -> PathBuf {
        let code = after(writes(before, REGION0, self.size as u32, seed));
        kernel_file(self.dir.path(), code)
    }

    /// The file holds exactly the host's pattern with the guest's `writes` over it.
    fn assert_written(&self, seed: u8) {
        assert_same(&self.path, &expected_after_writes(self.size, seed));
    }
}

#[test]
fn guest_stores_reach_the_file_on_clean_exit() {
    let region = Region::new(2 * MIB);
    // The guest first echoes a byte the host wrote, then stores, then exits.
    let k = region.kernel(Code::default().echo(REGION0 + 300), 11, |c| c.exit(0));
    let r = run_tiny(&k, &[region.spec()]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    assert_eq!(r.stdout.as_bytes(), [pre(300)], "{}", r.explain());
    region.assert_written(11);
}

#[test]
fn guest_stores_reach_the_file_when_the_guest_crashes() {
    let region = Region::new(2 * MIB);
    let k = region.kernel(Code::default(), 21, Code::triple_fault);
    let r = run_tiny(&k, &[region.spec()]);
    assert_eq!(r.code, Some(125), "{}", r.explain());
    assert!(r.stderr.contains("triple fault"), "{}", r.explain());
    region.assert_written(21);
}

/// Starts the VMM on a guest that stores, prints `W` and spins; returns once `W` arrived.
fn start_spinning(region: &Region, seed: u8) -> std::process::Child {
    let k = region.kernel(Code::default(), seed, |c| c.out8(0x3f8, b'W').spin());
    let mut child = Command::new(env!("CARGO_BIN_EXE_musubi"))
        .args(["run", "--kernel", k.to_str().unwrap(), "--memory", "32M"])
        .arg("--pmem")
        .arg(region.spec())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        while let Ok(1) = out.read(&mut b) {
            if b[0] == b'W' {
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(Duration::from_secs(60)).is_err() {
        let _ = child.kill();
        let mut err = String::new();
        let _ = child.stderr.take().unwrap().read_to_string(&mut err);
        panic!("the guest never reported its stores: {err}");
    }
    child
}

#[test]
fn guest_stores_reach_the_file_on_sigterm() {
    use std::os::unix::process::ExitStatusExt;
    let region = Region::new(2 * MIB);
    let mut child = start_spinning(&region, 31);
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = wait_with_limit(&mut child, Duration::from_secs(30), "musubi");
    assert_eq!(st.code(), Some(128 + libc::SIGTERM), "{st:?}");
    assert_eq!(st.signal(), None);
    region.assert_written(31);
}

#[test]
fn guest_stores_reach_the_file_on_sigkill() {
    use std::os::unix::process::ExitStatusExt;
    let region = Region::new(4 * MIB);
    let mut child = start_spinning(&region, 41);
    child.kill().unwrap();
    let st = wait_with_limit(&mut child, Duration::from_secs(30), "musubi");
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    // No teardown ran: the stores are in the file's page cache, which the host writes back.
    region.assert_written(41);
}

#[test]
fn two_regions_one_per_file_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let a = region_file(dir.path(), "a.img", 2 * MIB);
    let b = region_file(dir.path(), "b.img", 4 * MIB);
    let region1 = REGION0 + 2 * MIB as u32;
    let code = writes(Code::default(), REGION0, 2 * MIB as u32, 51);
    let code = writes(code, region1, 4 * MIB as u32, 61)
        .echo(region1 + 4 * MIB as u32 - 1)
        .exit(0);
    let k = kernel_file(dir.path(), code);
    // The second one advertised as virtio-pmem: the mapping is the same either way.
    let r = run_tiny(
        &k,
        &[
            format!("file={}", a.display()),
            format!("file={},advertise=virtio", b.display()),
        ],
    );
    assert_eq!(r.code, Some(0), "{}", r.explain());
    assert_eq!(r.stdout.as_bytes(), [63], "{}", r.explain());
    assert_same(&a, &expected_after_writes(2 * MIB, 51));
    assert_same(&b, &expected_after_writes(4 * MIB, 61));
}

#[test]
fn size_maps_a_prefix_and_leaves_the_rest_of_the_file_alone() {
    let dir = tempfile::tempdir().unwrap();
    let f = region_file(dir.path(), "p.img", 4 * MIB);
    let code = writes(Code::default(), REGION0, 2 * MIB as u32, 71).exit(0);
    let k = kernel_file(dir.path(), code);
    let r = run_tiny(&k, &[format!("file={},size=2M", f.display())]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let mut want = expected_after_writes(2 * MIB, 71);
    want.extend((2 * MIB..4 * MIB).map(pre));
    assert_same(&f, &want);
}

#[test]
fn readonly_region_drops_guest_stores_logs_them_and_the_guest_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let size = 2 * MIB;
    let f = region_file(dir.path(), "ro.img", size);
    // 100 stores, then read one of them back, then a marker, then exit.
    let code = Code::default()
        .fill(REGION0, 100, 1, 90)
        .echo(REGION0 + 5)
        .out8(0x3f8, b'K')
        .exit(0);
    let k = kernel_file(dir.path(), code);
    let r = run_tiny(&k, &[format!("file={},readonly=on", f.display())]);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    // The guest reads the host's byte, not the one it stored, and keeps running.
    assert_eq!(r.stdout.as_bytes(), [pre(5), b'K'], "{}", r.explain());
    assert_same(&f, &original(size));
    let logged: Vec<&str> = r
        .stderr
        .lines()
        .filter(|l| l.contains("is read-only: guest write"))
        .collect();
    // The first 8, then 16, 32 and 64: the log thins out instead of flooding.
    assert_eq!(logged.len(), 11, "{}", r.explain());
    assert!(
        logged[0].contains(&f.display().to_string()),
        "{}",
        logged[0]
    );
    assert!(logged[10].contains("(64 so far)"), "{}", logged[10]);
}

#[test]
fn guest_ram_is_unchanged_by_regions() {
    let dir = tempfile::tempdir().unwrap();
    let a = temp_image(dir.path(), "a.img", 4 << 20);
    let b = temp_image(dir.path(), "b.img", 2 << 20);
    let hello = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--kernel",
            "probe",
            "--memory",
            "64M",
            "--cmdline",
            "probe.tasks=hello",
            "--timeout",
            "120",
        ];
        args.extend_from_slice(extra);
        let r = run(&args);
        assert_eq!(r.code, Some(0), "{}", r.explain());
        r.result("hello")["memory_bytes"].as_u64().unwrap()
    };
    let pa = format!("file={}", a.display());
    let pb = format!("file={},advertise=virtio", b.display());
    assert_eq!(hello(&[]), hello(&["--pmem", &pa, "--pmem", &pb]));
}

fn refused(args: &[&str], needles: &[&str]) {
    refused_with(1, args, needles);
}

/// Refused with `status`: 1 for a region the configuration cannot have, 2 for a spec the
/// command-line parser cannot read.
fn refused_with(status: i32, args: &[&str], needles: &[&str]) {
    let r = run_with_limit(args, Duration::from_secs(60));
    assert_eq!(r.code, Some(status), "{args:?}: {}", r.explain());
    for n in needles {
        assert!(r.stderr.contains(n), "{args:?}: {n:?} not in {}", r.stderr);
    }
}

#[test]
fn bad_regions_are_refused_naming_the_flag_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ok = temp_image(d, "ok.img", 2 << 20);
    let empty = temp_image(d, "empty.img", 0);
    let odd = temp_image(d, "odd.img", 3 << 20);
    let missing = d.join("missing.img");
    let s = |p: &Path| p.display().to_string();
    let cases: [(String, &[&str]); 6] = [
        (
            format!("file={}", s(&missing)),
            &["--pmem file=", "missing.img", "no such file"],
        ),
        (
            format!("file={}", s(&empty)),
            &["--pmem file=", "empty.img", "empty"],
        ),
        (
            format!("file={}", s(&odd)),
            &[
                "--pmem file=",
                "odd.img",
                "not a whole number of 2 MiB",
                "4M",
            ],
        ),
        (
            format!("file={},size=4M", s(&ok)),
            &["--pmem file=", "ok.img", "size= asks for", "only"],
        ),
        (
            format!("file={},size=1M", s(&ok)),
            &["--pmem file=", "ok.img", "size= is"],
        ),
        (format!("file={}", s(d)), &["--pmem file=", "directory"]),
    ];
    for (spec, needles) in cases {
        refused(
            &[
                "run", "--kernel", "probe", "--memory", "32M", "--pmem", &spec,
            ],
            needles,
        );
    }
    let malformed: [(String, &[&str]); 4] = [
        (
            format!("path={}", s(&ok)),
            &["--pmem", "unknown key \"path\""],
        ),
        (
            format!("file={},advertise=acpi", s(&ok)),
            &["--pmem", "advertise=\"acpi\""],
        ),
        (
            format!("file={},readonly=perhaps", s(&ok)),
            &["--pmem", "readonly=\"perhaps\""],
        ),
        (
            format!("file={},size=lots", s(&ok)),
            &["--pmem", "invalid size"],
        ),
    ];
    for (spec, needles) in malformed {
        refused_with(
            2,
            &[
                "run", "--kernel", "probe", "--memory", "32M", "--pmem", &spec,
            ],
            needles,
        );
    }

    // The same file twice, and a file that is also a disk.
    let spec = format!("file={}", s(&ok));
    refused(
        &[
            "run", "--kernel", "probe", "--memory", "32M", "--pmem", &spec, "--pmem", &spec,
        ],
        &["--pmem file=", "ok.img", "already used by --pmem"],
    );
    let disk = format!("path={}", s(&ok));
    refused(
        &[
            "run", "--kernel", "probe", "--memory", "32M", "--disk", &disk, "--pmem", &spec,
        ],
        &["--pmem file=", "already used by --disk"],
    );
}

#[test]
fn more_regions_than_the_firmware_map_or_the_interrupt_lines_hold_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let specs: Vec<String> = (0..125)
        .map(|i| {
            let f = dir.path().join(format!("r{i}.img"));
            std::fs::File::create(&f).unwrap().set_len(2 * MIB).unwrap();
            format!("file={}", f.display())
        })
        .collect();
    let mut args = vec!["run", "--kernel", "probe", "--memory", "32M"];
    for s in &specs {
        args.extend(["--pmem", s.as_str()]);
    }
    refused(&args, &["--pmem", "125 regions advertised by E820"]);

    let virtio: Vec<String> = specs[..20]
        .iter()
        .map(|s| format!("{s},advertise=virtio"))
        .collect();
    let mut args = vec!["run", "--kernel", "probe", "--memory", "32M"];
    for s in &virtio {
        args.extend(["--pmem", s.as_str()]);
    }
    refused(
        &args,
        &["--pmem", "20 virtio-pmem devices", "interrupt lines"],
    );
}

#[test]
fn regions_come_from_the_json_config_too() {
    let region = Region::new(2 * MIB);
    let (f, k) = (
        &region.path,
        region.kernel(Code::default(), 81, |c| c.exit(0)),
    );
    let cfg = region.dir.path().join("vm.json");
    std::fs::write(
        &cfg,
        serde_json::json!({
            "kernel": k,
            "memory": "32M",
            "pmem": [{"file": f, "size": "2M", "advertise": "e820"}],
        })
        .to_string(),
    )
    .unwrap();
    let r = run_with_limit(
        &["run", "--config", cfg.to_str().unwrap(), "--timeout", "60"],
        Duration::from_secs(120),
    );
    assert_eq!(r.code, Some(0), "{}", r.explain());
    region.assert_written(81);

    std::fs::write(
        &cfg,
        serde_json::json!({"kernel": k, "pmem": [{"file": f, "size": "lots"}]}).to_string(),
    )
    .unwrap();
    refused(
        &["run", "--config", cfg.to_str().unwrap()],
        &["--config", "pmem[0].size", "invalid size \"lots\""],
    );
}

// The probe guest's memory-storage tasks: `pmem-fill=SEED` writes the `blk-fill` pattern
// over every region it finds (E820 type 12 or virtio-pmem) from user mode and flushes;
// `pmem-crc` reports each region's CRC-32.

fn probe_with_regions(tasks: &str, regions: &[String]) -> Run {
    let mut flags = vec!["--memory", "64M"];
    for r in regions {
        flags.extend(["--pmem", r.as_str()]);
    }
    run_probe(tasks, &flags)
}

fn crc_of(path: &Path) -> String {
    format!("{:#010x}", crc32fast::hash(&std::fs::read(path).unwrap()))
}

#[test]
fn probe_fill_and_crc_round_trip_with_both_advertisements() {
    let dir = tempfile::tempdir().unwrap();
    let a = temp_image(dir.path(), "e820.img", 4 << 20);
    let b = temp_image(dir.path(), "virtio.img", 2 << 20);
    let seed = 29;
    let r = probe_with_regions(
        &format!("pmem-fill={seed},pmem-crc"),
        &[
            format!("file={}", a.display()),
            format!("file={},advertise=virtio", b.display()),
        ],
    );
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let fill = r.result("pmem-fill");
    assert_eq!(fill["ok"], true, "{}", r.explain());
    let crc = r.result("pmem-crc");
    let regions = crc["regions"].as_array().unwrap();
    assert_eq!(regions.len(), 2, "{}", r.explain());
    for (i, (path, source)) in [(&a, "e820"), (&b, "virtio")].into_iter().enumerate() {
        let data = std::fs::read(path).unwrap();
        if let Some(o) = (0..data.len()).find(|&o| data[o] != fill_byte(o as u64, seed)) {
            panic!("{}: byte {o:#x} is not the fill pattern", path.display());
        }
        assert_eq!(regions[i]["index"], i as u64);
        assert_eq!(regions[i]["source"], source, "{}", r.explain());
        assert_eq!(regions[i]["bytes"], data.len() as u64);
        assert_eq!(regions[i]["crc32"], crc_of(path), "{}", r.explain());
    }
}

#[test]
fn probe_reads_what_the_host_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let a = region_file(dir.path(), "a.img", 2 << 20);
    let b = region_file(dir.path(), "b.img", 2 << 20);
    // A different pattern in the second file, so the regions cannot be confused.
    let mut data = std::fs::read(&b).unwrap();
    data.iter_mut().for_each(|x| *x ^= 0x5a);
    std::fs::write(&b, &data).unwrap();
    let r = probe_with_regions(
        "pmem-crc",
        &[
            format!("file={},advertise=virtio", a.display()),
            format!("file={},readonly=on", b.display()),
        ],
    );
    assert_eq!(r.code, Some(0), "{}", r.explain());
    // The guest numbers E820 regions before virtio-pmem ones; match them by source.
    let crc = r.result("pmem-crc");
    let by_source = |src: &str| {
        crc["regions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["source"] == src)
            .unwrap_or_else(|| panic!("no {src} region: {}", r.explain()))["crc32"]
            .clone()
    };
    assert_eq!(by_source("virtio"), crc_of(&a), "{}", r.explain());
    assert_eq!(by_source("e820"), crc_of(&b), "{}", r.explain());
}

#[test]
fn probe_fill_on_a_readonly_region_fails_in_the_guest_and_spares_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = region_file(dir.path(), "ro.img", 2 << 20);
    let r = probe_with_regions(
        "pmem-fill=3,pmem-crc",
        &[format!("file={},readonly=on", f.display())],
    );
    // The guest reports the failed fill (status 3) and runs its next task: the VMM neither
    // crashed nor stopped.
    assert_eq!(r.code, Some(3), "{}", r.explain());
    assert_eq!(r.result("pmem-fill")["ok"], false, "{}", r.explain());
    assert_eq!(
        r.result("pmem-crc")["regions"][0]["crc32"],
        crc_of(&f),
        "{}",
        r.explain()
    );
    assert_same(&f, &original(2 << 20));
    assert!(
        r.stderr.contains("is read-only: guest write"),
        "{}",
        r.explain()
    );
}
