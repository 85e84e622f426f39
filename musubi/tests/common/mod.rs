//! Shared helpers for tests that run the `musubi` binary.
#![allow(dead_code)]

pub mod vsock;

use serde_json::Value;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

// Each test binary uses some of these.
#[allow(unused_imports)]
pub use testkit::tcp::{free_port, listening_at, listening_in, listening_on_loopback, secret_file};
#[allow(unused_imports)]
pub use testkit::{
    assert_kvm, fake_vmm, netns, read_text, result_in, results_in, run_command, start_command,
    wait_until, wait_with_limit, Run, Started,
};

/// The `musubi` binary under test.
pub const MUSUBI: &str = env!("CARGO_BIN_EXE_musubi");

pub fn musubi() -> Command {
    Command::new(MUSUBI)
}

/// Runs `musubi` with `args`, killing it after `limit` so a hung VM fails the test
/// instead of hanging the suite.
pub fn run_with_limit<S: AsRef<OsStr>>(args: &[S], limit: Duration) -> Run {
    run_with_stdin(args, None, limit)
}

/// As [`run_with_limit`], with `input` written to a pipe on stdin, which is then closed
/// (stdin is empty without it).
pub fn run_with_stdin<S: AsRef<OsStr>>(args: &[S], input: Option<&[u8]>, limit: Duration) -> Run {
    run_command(musubi(), args, input, limit)
}

pub fn run<S: AsRef<OsStr>>(args: &[S]) -> Run {
    run_with_limit(args, Duration::from_secs(240))
}

/// Runs the bundled probe guest with `tasks` (the `probe.tasks=` list), adding `flags` to
/// `musubi run`; the VM itself gives up after 200 s.
pub fn run_probe(tasks: &str, flags: &[&str]) -> Run {
    let args = probe_args(tasks, flags);
    run(&args)
}

/// The `musubi run` arguments of [`run_probe`].
pub fn probe_args(tasks: &str, flags: &[&str]) -> Vec<String> {
    let cmdline = format!("probe.tasks={tasks}");
    let mut args = vec![
        "run",
        "--kernel",
        "probe",
        "--timeout",
        "200",
        "--cmdline",
        &cmdline,
    ];
    args.extend_from_slice(flags);
    args.into_iter().map(String::from).collect()
}

/// Byte `offset` of a disk after the probe guest's `blk-fill=SEED`.
pub fn fill_byte(offset: u64, seed: u64) -> u8 {
    (((offset / 512) * 131 + offset % 512 + seed) % 256) as u8
}

pub fn temp_image(dir: &Path, name: &str, bytes: usize) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, vec![0u8; bytes]).unwrap();
    p
}

/// A directory on a filesystem that supports O_DIRECT (tmpfs does not).
pub fn direct_io_dir() -> tempfile::TempDir {
    let base = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

/// Debian's cloud kernel (`vmlinux`, the PVH ELF, or `vmlinuz`, the bzImage), fetched and
/// unpacked with `scripts/fetch-linux.sh` into `$MUSUBI_LINUX_DIR` (default: the user's
/// cache) on first use.
pub fn linux_kernel(name: &str) -> PathBuf {
    let dir = std::env::var_os("MUSUBI_LINUX_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache")
                });
            cache.join("musubi/linux")
        });
    let path = dir.join(name);
    if !path.exists() {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-linux.sh");
        let st = Command::new("bash")
            .arg(&script)
            .arg(&dir)
            .status()
            .expect("fetch-linux.sh runs");
        assert!(
            st.success(),
            "{} could not fetch Debian's kernel into {}",
            script.display(),
            dir.display()
        );
    }
    assert!(
        path.exists(),
        "{} is missing after fetch-linux.sh",
        path.display()
    );
    path
}

/// `musubi remote --api-socket SOCKET ARGS...`, bounded to a minute.
pub fn remote(socket: &Path, args: &[&str]) -> Run {
    let socket = socket.to_str().unwrap();
    let mut all = vec!["remote", "--api-socket", socket];
    all.extend_from_slice(args);
    run_with_limit(&all, Duration::from_secs(60))
}

/// `musubi remote send-migration URL --secret-file KEY` to the VM whose API is `socket`.
pub fn send_migration_to(socket: &Path, url: &str, key: &Path) -> Run {
    remote(
        socket,
        &[
            "send-migration",
            url,
            "--secret-file",
            key.to_str().unwrap(),
        ],
    )
}

/// As [`remote`], requiring success, with the answer parsed as JSON (`null` if empty).
pub fn remote_json(socket: &Path, args: &[&str]) -> Value {
    let r = remote(socket, args);
    assert_eq!(r.code, Some(0), "remote {args:?}: {}", r.explain());
    if r.stdout.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&r.stdout)
            .unwrap_or_else(|e| panic!("remote {args:?}: not JSON ({e}): {}", r.explain()))
    }
}

/// The probe guest with `tasks` started with its API on `socket` and its console in the
/// file `serial`, `flags` added to `musubi run`.
pub fn start_probe_with_api(tasks: &str, socket: &Path, serial: &Path, flags: &[&str]) -> Started {
    let serial = format!("file={}", serial.display());
    let mut all = vec![
        "--api-socket",
        socket.to_str().unwrap(),
        "--serial",
        serial.as_str(),
    ];
    all.extend_from_slice(flags);
    let args = probe_args(tasks, &all);
    start_command(musubi(), &args, None)
}

/// `fib(n)`, the value the probe guest's `fib=N` task reports.
pub fn fib_value(n: u64) -> u64 {
    let (mut a, mut b) = (0u64, 1u64);
    for _ in 0..n {
        (a, b) = (b, a.wrapping_add(b));
    }
    a
}

/// Kills a started musubi process if the test panics before [`KillOnPanic::defuse`], so a
/// failed assertion does not leave its VM running until its own `--timeout`.
pub struct KillOnPanic(Option<u32>);

impl KillOnPanic {
    pub fn new(vm: &Started) -> Self {
        KillOnPanic(Some(vm.child.id()))
    }

    /// Called before the process is waited for (its pid may be reused after).
    pub fn defuse(mut self) {
        self.0 = None;
    }
}

impl Drop for KillOnPanic {
    fn drop(&mut self) {
        if let (Some(pid), true) = (self.0, std::thread::panicking()) {
            // SAFETY: kill(2) on our own child, not yet waited for.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

/// A `shared-counter` result of `cpus` CPUs each counting `per_cpu`: both ways of counting
/// (a spinlock and `lock xadd`) reached the exact total. `context` is shown on failure.
pub fn assert_counter_exact(c: &Value, cpus: u64, per_cpu: u64, context: &str) {
    let expected = cpus * per_cpu;
    assert_eq!(c["cpus"].as_u64(), Some(cpus), "{context}");
    assert_eq!(c["expected"].as_u64(), Some(expected), "{context}");
    assert_eq!(c["locked"].as_u64(), Some(expected), "{context}");
    assert_eq!(c["xadd"].as_u64(), Some(expected), "{context}");
    assert_eq!(c["exact"], true, "{context}");
}

/// A waiting VMM's working directory: its API socket and the console file a VmConfig from
/// [`ch_vm_config`] writes to, both inside it.
pub struct VmmDir {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub serial: PathBuf,
}

impl VmmDir {
    pub fn new() -> VmmDir {
        let dir = tempfile::tempdir().unwrap();
        let (socket, serial) = (dir.path().join("api.sock"), dir.path().join("console.out"));
        VmmDir {
            dir,
            socket,
            serial,
        }
    }

    /// Writes a Cloud Hypervisor VmConfig named `name` booting the probe guest with
    /// `tasks` (1 vCPU, 128 MiB), its console into this directory's console file.
    pub fn ch_vm_config(&self, name: &str, tasks: &str, limit: Duration) -> PathBuf {
        let probe = run_with_limit(&["guest", "path"], limit);
        assert_eq!(probe.code, Some(0), "guest path: {}", probe.explain());
        let config = serde_json::json!({
            "payload": {"kernel": probe.stdout.trim(), "cmdline": format!("probe.tasks={tasks}")},
            "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
            "memory": {"size": 128u64 << 20, "shared": false, "hugepages": false},
            "serial": {"mode": "File", "file": self.serial},
            "console": {"mode": "Off"},
            "musubi": {"exits": "kernel"},
        });
        let path = self.dir.path().join(name);
        std::fs::write(&path, config.to_string()).unwrap();
        path
    }

    /// `musubi vmm` serving this directory's socket, once the socket is there.
    pub fn start_vmm(&self, limit: Duration) -> Started {
        self.start_vmm_with(&[], limit)
    }

    /// As [`VmmDir::start_vmm`], with more flags of `musubi vmm`.
    pub fn start_vmm_with(&self, flags: &[&str], limit: Duration) -> Started {
        let mut args = vec!["vmm", "--api-socket", self.socket.to_str().unwrap()];
        args.extend_from_slice(flags);
        let mut vmm = start_command(musubi(), &args, None);
        vmm.wait_for_file(&self.socket, limit);
        vmm
    }
}

/// A number in a probe result.
pub fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// `mem-check=MEM_CHECK_MIB,iters=MEM_CHECK_ROUNDS` in a `MEM_CHECK_MEMORY` VM: 64 MiB
/// written, then a sixteenth of it rewritten per round, for several seconds, so a move or a
/// failover lands while pages the other side has not seen yet are being rewritten.
pub const MEM_CHECK_MIB: u64 = 64;
pub const MEM_CHECK_ROUNDS: u64 = 5000;
pub const MEM_CHECK_MEMORY: &str = "512M";

/// The console `text` of a VM that ran `mem-check` of [`MEM_CHECK_MIB`] for `rounds`: every
/// byte read back as written.
pub fn assert_mem_check(text: &str, rounds: u64) {
    let m = result_in(text, "mem-check");
    assert_eq!(
        (u(&m["mib"]), u(&m["rounds"]), u(&m["errors"])),
        (MEM_CHECK_MIB, rounds, 0),
        "{text}"
    );
    assert_eq!(m["ok"], true, "{text}");
}

/// `musubi` with `args`, once it listens on loopback `port` (a VM that waits for another
/// musubi), failing the test after `limit`.
pub fn start_listening(args: &[&str], port: u16, limit: Duration) -> Started {
    let mut vm = start_command(musubi(), args, None);
    vm.wait_for(
        limit,
        || listening_on_loopback(port).then_some(()),
        || format!("a socket listening on port {port}"),
    );
    vm
}
