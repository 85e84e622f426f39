//! The interactive console: what is typed on a terminal or piped into `musubi run --serial
//! stdio` reaches the probe guest's COM1, Ctrl-A x quits, and the terminal is put back.

mod common;
use common::*;
use musubi_types::{Outcome, RunReport};
use serde_json::Value;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Every wait of these tests ends by then: a VM that never boots fails, not hangs.
const LIMIT: Duration = Duration::from_secs(240);
/// What the probe guest prints once it waits for console input.
const PROMPT: &str = "console-echo: type a line";

fn args(tasks: &str, report: &std::path::Path) -> Vec<String> {
    let report = report.to_str().unwrap();
    probe_args(tasks, &["--serial", "stdio", "--report", report])
}

/// A pseudo-terminal with `musubi` on its slave side and everything it prints collected
/// from the master side.
struct OnTerminal {
    child: Child,
    master: std::fs::File,
    /// Held so the terminal's settings can be read after `musubi` ends.
    slave: Option<OwnedFd>,
    /// The terminal's settings before `musubi` started, read before the spawn so the
    /// program cannot have changed them yet.
    before: libc::termios,
    output: Arc<Mutex<Vec<u8>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

fn termios(fd: &OwnedFd) -> libc::termios {
    // SAFETY: an all-zero termios is valid and tcgetattr only writes it.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the descriptor is live.
    let r = unsafe { libc::tcgetattr(fd.as_raw_fd(), &mut t) };
    assert_eq!(r, 0, "tcgetattr: {}", std::io::Error::last_os_error());
    t
}

/// The fields a program changes when it makes a terminal raw.
fn settings(t: &libc::termios) -> (u32, u32, u32, u32, Vec<u8>) {
    (t.c_iflag, t.c_oflag, t.c_cflag, t.c_lflag, t.c_cc.to_vec())
}

impl OnTerminal {
    fn start(args: &[String]) -> OnTerminal {
        common::assert_kvm();
        let (mut m, mut s) = (0, 0);
        // SAFETY: openpty writes the two descriptors; no name or settings are asked for.
        let r = unsafe {
            libc::openpty(
                &mut m,
                &mut s,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: both descriptors are fresh and owned by nothing else.
        let (master, slave) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
        let io = || Stdio::from(slave.try_clone().unwrap());
        let before = termios(&slave);
        let child = musubi()
            .args(args)
            .stdin(io())
            .stdout(io())
            .stderr(io())
            .spawn()
            .expect("musubi starts");
        let master = std::fs::File::from(master);
        let output = Arc::new(Mutex::new(Vec::new()));
        let (mut from, into) = (master.try_clone().unwrap(), output.clone());
        // Ends with an error (EIO) once no slave descriptor is left open.
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = from.read(&mut buf) {
                into.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        OnTerminal {
            child,
            master,
            slave: Some(slave),
            before,
            output,
            reader: Some(reader),
        }
    }

    fn termios(&self) -> libc::termios {
        termios(self.slave.as_ref().unwrap())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    fn wait_for_output(&self, needle: &str) {
        assert!(
            wait_until(LIMIT, || self.text().contains(needle)),
            "no {needle:?} within {LIMIT:?}; output:\n{}",
            self.text()
        );
    }

    fn type_in(&mut self, bytes: &[u8]) {
        self.master.write_all(bytes).unwrap();
    }

    /// Waits for `musubi` to end; returns its status and everything it printed.
    fn finish(mut self) -> (Option<i32>, String, libc::termios) {
        let status = wait_with_limit(&mut self.child, LIMIT, "musubi on a terminal");
        let after = self.termios();
        // The reader sees the end of the terminal once no slave descriptor is open.
        self.slave = None;
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let text = String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned();
        (status.code(), text, after)
    }
}

impl Drop for OnTerminal {
    fn drop(&mut self) {
        // A failed assertion must not leave a VM running.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn echo_result(output: &str) -> Value {
    output
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("{\"probe\":\"console-echo\""))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .unwrap_or_else(|| panic!("no console-echo result in:\n{output}"))
}

fn outcome(report: &std::path::Path) -> Outcome {
    let text = std::fs::read_to_string(report).unwrap();
    serde_json::from_str::<RunReport>(&text).unwrap().outcome
}

/// Runs the probe guest's `tasks` on a terminal, waits for the `console-echo` prompt, then
/// does `act`; returns the status, the terminal output and the report's outcome. Checks
/// that the terminal was raw meanwhile and is as it was afterwards.
fn on_a_terminal(tasks: &str, act: impl FnOnce(&mut OnTerminal)) -> (Option<i32>, String, Outcome) {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut t = OnTerminal::start(&args(tasks, &report));
    let before = t.before;
    t.wait_for_output(PROMPT);
    let during = t.termios();
    assert_eq!(
        during.c_lflag & (libc::ICANON | libc::ECHO | libc::ISIG),
        0,
        "the terminal is not raw while the guest runs"
    );
    act(&mut t);
    let (code, output, after) = t.finish();
    assert_eq!(
        settings(&after),
        settings(&before),
        "terminal not restored:\n{output}"
    );
    (code, output, outcome(&report))
}

/// What `musubi` did when `input` was typed once the guest's `console-echo` task waited.
fn type_at_the_prompt(input: &[u8]) -> (Option<i32>, String, Outcome) {
    on_a_terminal("console-echo", |t| t.type_in(input))
}

#[test]
fn a_line_typed_on_a_terminal_reaches_the_guest_and_the_terminal_is_restored() {
    let (code, output, outcome) = type_at_the_prompt(b"hello musubi\r");
    assert_eq!(code, Some(0), "{output}");
    assert_eq!(outcome.kind(), "guest_exit", "{output}");
    let r = echo_result(&output);
    assert_eq!(r["ok"], true, "{output}");
    assert_eq!(r["line"], "hello musubi", "{output}");
    assert!(
        r["rx_interrupts"].as_u64().unwrap() > 0,
        "no receive interrupt reached the guest: {output}"
    );
}

#[test]
fn ctrl_a_x_on_a_terminal_quits_with_status_0() {
    // Ctrl-A Ctrl-A is a literal Ctrl-A for the guest; Ctrl-A x is for the VMM.
    let (code, output, outcome) = type_at_the_prompt(b"ab\x01\x01\x01x");
    assert_eq!(code, Some(0), "{output}");
    assert_eq!(outcome.kind(), "console_quit", "{output}");
    assert!(output.contains("Ctrl-A x"), "{output}");
    assert!(
        !output.contains("{\"probe\":\"console-echo\""),
        "the guest got a whole line: {output}"
    );
}

#[test]
fn piped_input_reaches_the_guest_and_its_end_leaves_the_vm_running() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let args = args("console-echo,hello", &report);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // Written and closed before the guest boots: the bytes wait in the UART's FIFO.
    let r = run_with_stdin(&args, Some(b"hello musubi\n"), LIMIT);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let e = r.result("console-echo");
    assert_eq!(e["line"], "hello musubi", "{}", r.explain());
    assert!(e["rx_interrupts"].as_u64().unwrap() > 0, "{}", r.explain());
    // The task after it ran: the end of stdin did not stop the VM.
    r.result("hello");
    assert_eq!(outcome(&report).kind(), "guest_exit");
}

#[test]
fn no_input_ends_the_task_with_a_timeout_error() {
    let r = run_probe("console-echo=1", &[]);
    assert_eq!(r.code, Some(5), "{}", r.explain());
    let e = r.result("console-echo");
    assert_eq!(e["ok"], false, "{}", r.explain());
    assert!(
        e["error"].as_str().unwrap().contains("within 1 s"),
        "{}",
        r.explain()
    );
}

#[test]
fn sigterm_restores_the_terminal() {
    let (code, output, outcome) = on_a_terminal("console-echo", |t| {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(t.child.id() as libc::pid_t, libc::SIGTERM) };
    });
    assert_eq!(code, Some(128 + libc::SIGTERM), "{output}");
    assert_eq!(outcome.kind(), "signal", "{output}");
}

#[test]
fn a_guest_crash_restores_the_terminal() {
    let (code, output, outcome) =
        on_a_terminal("console-echo=60,triple-fault", |t| t.type_in(b"\r"));
    assert_eq!(code, Some(125), "{output}");
    assert_eq!(outcome.kind(), "guest_crash", "{output}");
}
