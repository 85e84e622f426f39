//! `musubi bench all`: runs every experiment and writes one HTML page that sets each
//! report beside its chart, its verdicts and the machine it ran on.
//!
//! Each experiment runs as a child `musubi bench EXPERIMENT` process: a panic, a hung VM
//! or a missing privilege in one (mint's cgroups) then fails that experiment alone, and the
//! page shows its error while the others still run.

use super::BenchArgs;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime};

/// One experiment's run as the page shows it.
struct Outcome {
    name: &'static str,
    stdout: String,
    stderr: String,
    /// Why the experiment did not succeed; None when it exited 0.
    error: Option<String>,
    started: SystemTime,
    seconds: f64,
}

/// A full-size vmms run at the paper's 512 MB moves gigabytes through an emulated CPL0;
/// these bound a wedged child, not a slow one.
fn limit(quick: bool) -> Duration {
    Duration::from_secs(if quick { 900 } else { 6 * 3600 })
}

pub fn run(args: &BenchArgs) -> ExitCode {
    if let Err(e) = std::fs::create_dir_all(&args.out) {
        eprintln!(
            "musubi bench all: --out {}: cannot create the directory: {e}",
            args.out.display()
        );
        return ExitCode::from(1);
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("musubi bench all: cannot find this program to run the experiments: {e}");
            return ExitCode::from(1);
        }
    };
    let mut outcomes = Vec::new();
    for name in super::EXPERIMENTS {
        println!("== musubi bench {name}");
        let o = run_one(&exe, name, args);
        if let Some(e) = &o.error {
            println!("== {name}: FAILED: {e}");
        }
        outcomes.push(o);
    }
    let page = args.out.join("index.html");
    let html = page_html(&outcomes, &Machine::here(), &args.out, args.quick);
    if let Err(e) = std::fs::write(&page, html) {
        eprintln!("musubi bench all: {}: {e}", page.display());
        return ExitCode::from(1);
    }
    let failed: Vec<&str> = outcomes
        .iter()
        .filter(|o| o.error.is_some())
        .map(|o| o.name)
        .collect();
    println!("page: {}", page.display());
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("musubi bench all: failed: {}", failed.join(", "));
        ExitCode::from(1)
    }
}

/// Runs one experiment, passing its output through as it comes and keeping a copy, which
/// is also written to `EXPERIMENT.log` so each report can be read alone.
fn run_one(exe: &Path, name: &'static str, args: &BenchArgs) -> Outcome {
    let mut cmd = Command::new(exe);
    cmd.args([name, "--out"]).arg(&args.out);
    if args.quick {
        cmd.arg("--quick");
    }
    if matches!(
        name,
        "boot" | "vmms" | "snapshot" | "migrate" | "net" | "api" | "vsock"
    ) {
        if let Some(c) = &args.compare {
            cmd.args(["--compare", c]);
        }
        if let Some(q) = &args.qemu {
            cmd.arg("--qemu").arg(q);
        }
    }
    if let (Some(e), "vmms") = (&args.extent, name) {
        cmd.args(["--extent", e]);
    }
    if let (Some(n), "vmp") = (args.nodes, name) {
        cmd.args(["--nodes", &n.to_string()]);
    }
    if let (Some(p), "api") = (&args.ch_remote, name) {
        cmd.arg("--ch-remote").arg(p);
    }
    let (start, started) = (Instant::now(), SystemTime::now());
    let outcome = |stdout: String, stderr: String, error: Option<String>| Outcome {
        name,
        stdout,
        stderr,
        error,
        started,
        seconds: start.elapsed().as_secs_f64(),
    };
    let mut child = match cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            return outcome(
                String::new(),
                String::new(),
                Some(format!("cannot start: {e}")),
            )
        }
    };
    let out = tee(child.stdout.take(), false);
    let err = tee(child.stderr.take(), true);
    let limit = limit(args.quick);
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if start.elapsed() > limit => {
                // SIGTERM first, so the experiment's guards remove what it created
                // (partitions, cgroups, scratch files); SIGKILL if that does not end it.
                // SAFETY: kill(2) on our own child, which is not yet reaped.
                unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
                let grace = Instant::now();
                while grace.elapsed() < Duration::from_secs(10) {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!("did not finish within {} s", limit.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => break Err(format!("cannot wait for it: {e}")),
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    let _ = std::fs::write(args.out.join(format!("{name}.log")), &stdout);
    let error = match status {
        Ok(s) if s.success() => None,
        Ok(s) => Some(format!(
            "{s}{}",
            last_line(&stderr)
                .map(|l| format!(": {l}"))
                .unwrap_or_default()
        )),
        Err(e) => Some(e),
    };
    outcome(stdout, stderr, error)
}

/// Copies a child's stream to ours line by line while keeping it; ends when the child
/// closes the stream.
fn tee<R: Read + Send + 'static>(
    stream: Option<R>,
    to_stderr: bool,
) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut kept = String::new();
        let Some(stream) = stream else { return kept };
        let mut lines = BufReader::new(stream);
        let mut line = Vec::new();
        while lines.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
            let text = String::from_utf8_lossy(&line);
            if to_stderr {
                let _ = std::io::stderr().write_all(text.as_bytes());
            } else {
                let _ = std::io::stdout().write_all(text.as_bytes());
            }
            kept.push_str(&text);
            line.clear();
        }
        kept
    })
}

fn last_line(s: &str) -> Option<&str> {
    s.lines().rev().map(str::trim).find(|l| !l.is_empty())
}

/// The lines of a report that judge a figure against the paper's.
fn verdicts(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter(|l| {
            l.split(|c: char| !c.is_ascii_alphabetic())
                .any(|w| w == "MET" || w == "MISSED")
        })
        .collect()
}

/// The charts an experiment wrote in this run, as paths relative to the page: `NAME.svg`
/// and `NAME-*.svg` in the output directory, written since it started (a chart left by an
/// earlier run of an experiment that failed this time is not its chart).
fn charts(name: &str, out: &Path, since: SystemTime) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(out) else {
        return Vec::new();
    };
    let mut found: Vec<String> = dir
        .flatten()
        .filter_map(|e| {
            let file = e.file_name().to_str()?.to_string();
            let stem = file.strip_suffix(".svg")?;
            let ours = stem == name || stem.starts_with(&format!("{name}-"));
            let fresh = e.metadata().ok()?.modified().ok()? >= since;
            (ours && fresh).then_some(file)
        })
        .collect();
    found.sort();
    found
}

/// What the figures were measured on: they depend on it (nested KVM distorts them).
struct Machine {
    cpu: String,
    kernel: String,
    kvm: String,
    date: String,
    commit: String,
}

impl Machine {
    fn here() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |key: &str| {
            cpuinfo
                .lines()
                .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        let under_hypervisor =
            field("flags").is_some_and(|f| f.split_whitespace().any(|flag| flag == "hypervisor"));
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        Machine {
            cpu: field("model name").unwrap_or_else(|| "unknown".into()),
            kernel,
            kvm: kvm_flavour(under_hypervisor),
            date: command_line("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"])
                .unwrap_or_else(|| "unknown".into()),
            commit: commit(),
        }
    }
}

fn kvm_flavour(under_hypervisor: bool) -> String {
    let mut parts = Vec::new();
    parts.push(if under_hypervisor {
        "nested: this host is itself a guest (CPU flag `hypervisor`)".to_string()
    } else {
        "bare metal (no `hypervisor` CPU flag)".to_string()
    });
    for m in ["kvm_intel", "kvm_amd"] {
        let p = format!("/sys/module/{m}/parameters/nested");
        if let Ok(v) = std::fs::read_to_string(&p) {
            parts.push(format!("{m} nested={}", v.trim()));
        }
    }
    if !Path::new("/dev/kvm").exists() {
        parts.push("no /dev/kvm".into());
    }
    parts.join("; ")
}

/// The source tree's commit when the program runs from one, else the one it was built from.
fn commit() -> String {
    command_line(
        "git",
        &[
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "rev-parse",
            "--short",
            "HEAD",
        ],
    )
    .or_else(|| option_env!("MUSUBI_COMMIT").map(str::to_string))
    .unwrap_or_else(|| "unknown".into())
}

/// A short command's first output line, or None if it fails; bounded by the command's own
/// nature (git and date return at once), with stdin closed so neither can wait on us.
fn command_line(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

fn page_html(outcomes: &[Outcome], m: &Machine, out: &Path, quick: bool) -> String {
    let mut h = String::new();
    let title = if quick {
        "musubi bench all --quick"
    } else {
        "musubi bench all"
    };
    let _ = writeln!(
        h,
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title>\n\
         <style>body{{font-family:sans-serif;max-width:72em;margin:1em auto}}\
         pre{{background:#f4f4f4;padding:.5em;overflow-x:auto;font-size:85%}}\
         .fail{{color:#a00}} .ok{{color:#060}} td,th{{text-align:left;padding:0 1em 0 0}}</style>\n\
         </head><body>\n<h1>{t}</h1>",
        t = esc(title)
    );
    h.push_str("<h2 id=\"machine\">Machine</h2>\n<table>\n");
    for (k, v) in [
        ("CPU", &m.cpu),
        ("kernel", &m.kernel),
        ("KVM", &m.kvm),
        ("date", &m.date),
        ("Musubi commit", &m.commit),
    ] {
        let _ = writeln!(h, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(v));
    }
    h.push_str("</table>\n<h2>Experiments</h2>\n<ul>\n");
    for o in outcomes {
        let state = match &o.error {
            None => "<span class=\"ok\">ok</span>".to_string(),
            Some(_) => "<span class=\"fail\">FAILED</span>".to_string(),
        };
        let _ = writeln!(
            h,
            "<li><a href=\"#{n}\">{n}</a>: {state}, {:.0} s</li>",
            o.seconds,
            n = esc(o.name)
        );
    }
    h.push_str("</ul>\n");
    for o in outcomes {
        let n = esc(o.name);
        let _ = writeln!(h, "<section id=\"{n}\">\n<h2>{n}</h2>");
        if let Some(e) = &o.error {
            let _ = writeln!(h, "<p class=\"fail\">FAILED: {}</p>", esc(e));
            if !o.stderr.trim().is_empty() {
                let _ = writeln!(h, "<pre>{}</pre>", esc(&o.stderr));
            }
        }
        let v = verdicts(&o.stdout);
        if !v.is_empty() {
            h.push_str("<h3>Verdicts</h3>\n<pre>");
            for l in v {
                let _ = writeln!(h, "{}", esc(l));
            }
            h.push_str("</pre>\n");
        }
        for c in charts(o.name, out, o.started) {
            let c = esc(&c);
            let _ = writeln!(
                h,
                "<p><a href=\"{c}\"><img src=\"{c}\" alt=\"{c}\" style=\"max-width:100%\"></a></p>"
            );
        }
        let csv = format!("{}.csv", o.name);
        if out.join(&csv).is_file() {
            let _ = writeln!(h, "<p>rows: <a href=\"{0}\">{0}</a></p>", esc(&csv));
        }
        let _ = writeln!(
            h,
            "<h3>Report (ours beside the paper's)</h3>\n<pre>{}</pre>\n</section>",
            esc(&o.stdout)
        );
    }
    h.push_str("</body></html>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(name: &'static str, stdout: &str, error: Option<&str>) -> Outcome {
        Outcome {
            name,
            stdout: stdout.into(),
            stderr: "stderr <here>".into(),
            error: error.map(str::to_string),
            started: SystemTime::UNIX_EPOCH,
            seconds: 1.0,
        }
    }

    #[test]
    fn the_page_escapes_text_links_charts_relatively_and_shows_failures() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["seq.svg", "seq-2.svg", "sequel.svg", "seq.csv"] {
            std::fs::write(dir.path().join(f), "<svg/>").unwrap();
        }
        let outs = [
            outcome("seq", "fib  1 < 2  MET  paper\nother MISSEDX\n", None),
            outcome("mint", "", Some("exit status: 1: needs root & cgroups")),
        ];
        let m = Machine {
            cpu: "A <cpu>".into(),
            kernel: "6.18".into(),
            kvm: "nested".into(),
            date: "today".into(),
            commit: "abc1234".into(),
        };
        let page = page_html(&outs, &m, dir.path(), true);
        assert!(page.contains("<section id=\"seq\">") && page.contains("<section id=\"mint\">"));
        let images: Vec<&str> = page.split("<img src=\"").skip(1).collect();
        assert_eq!(images.len(), 2, "{page}");
        assert!(images[0].starts_with("seq-2.svg\"") && images[1].starts_with("seq.svg\""));
        assert!(page.contains("fib  1 &lt; 2  MET  paper"), "{page}");
        assert!(page.contains("A &lt;cpu&gt;") && page.contains("abc1234"));
        assert!(page.contains("FAILED: exit status: 1: needs root &amp; cgroups"));
        assert!(page.contains("stderr &lt;here&gt;"));
        assert_eq!(verdicts(&outs[0].stdout), ["fib  1 < 2  MET  paper"]);
    }
}
