//! Output commit and failover on the network: a replicated VM's primary and standby each
//! run in a namespace of their own, their TAP on a bridge there, and a client in a third
//! namespace whose bridge joins the two over veth pairs (the replication link runs over the
//! same bridges). The primary is killed with SIGKILL; the client, which saw only output
//! whose epoch the standby held, goes on with the standby as if nothing happened.
//!
//! The standby acknowledges an epoch before the primary writes that epoch's held frames;
//! the frames went to the standby with the epoch, so a primary killed in between has the
//! standby send them when it takes over, unless the primary said it had written them. What
//! is left is a kill between the primary's writes and its saying so (microseconds), which
//! sends them twice: no protocol closes that window, since the TAP write and the message to
//! the standby cannot be one act. So no answer may be lost, and one may come twice only as
//! that window allows: a copy of the answer just before it, arriving after the kill, from a
//! standby that says it sent frames for its primary.
//!
//! Every wait is bounded in time; the namespaces (and every interface in them) go when the
//! test ends, however it ends.

mod common;
use common::netns::{ip, Netns};
use common::*;
use std::io::Read;
use std::net::{TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use testkit::replica_net::{ReplicaNet as Net, CLIENT, GUEST, STANDBY_HOST};

const COUNTER_PORT: u16 = 7000;
const SINK_PORT: u16 = 9000;
const LIMIT: Duration = Duration::from_secs(60);
/// A standby notices a killed primary at once (the link closes); silence is for a primary
/// that hangs, and a loaded machine's stall of a live primary must not pass for one (the
/// standby would run beside it, and the primary's released output would draw the bridges
/// back to it).
const HEARTBEAT_MS: &str = "1000";
const EPOCH_MS: &str = "20";

/// Whether the process `pid` (in whatever namespace) has a TCP socket listening on `port`.
fn listening(pid: u32, port: u16) -> bool {
    let want = format!(":{port:04X} ");
    std::fs::read_to_string(format!("/proc/{pid}/net/tcp"))
        .map(|t| {
            t.lines()
                .any(|l| l.split_whitespace().nth(3) == Some("0A") && l.contains(&want))
        })
        .unwrap_or(false)
}

/// `musubi run --standby-for` in the standby's namespace, listening once this returns; its
/// metrics go to `serial` with the extension `json`.
fn start_standby(net: &Net, port: u16, secret: &Path, serial: &Path) -> Started {
    let url = format!("tcp:{STANDBY_HOST}:{port}");
    let metrics = serial.with_extension("json");
    let serial = format!("file={}", serial.display());
    let args = [
        "run",
        "--standby-for",
        &url,
        "--secret-file",
        secret.to_str().unwrap(),
        "--heartbeat",
        HEARTBEAT_MS,
        "--serial",
        &serial,
        "--metrics",
        metrics.to_str().unwrap(),
        "--timeout",
        "60",
    ];
    let mut vm = start_command(net.standby.command(MUSUBI), &args, None);
    let pid = vm.child.id();
    vm.wait_for(
        LIMIT,
        || listening(pid, port).then_some(()),
        || format!("the standby listening on port {port}"),
    );
    vm
}

/// The primary in its namespace, replicating to the standby on `port`.
fn start_primary(
    net: &Net,
    dir: &Path,
    port: u16,
    secret: &Path,
    tasks: &str,
    mac: &str,
    exits: &str,
) -> (Started, PathBuf) {
    let url = format!("tcp:{STANDBY_HOST}:{port}");
    let metrics = dir.join("primary-metrics.json");
    let serial = format!("file={}", metrics.with_extension("out").display());
    let cmdline = format!("probe.ip={GUEST}/24 probe.tasks={tasks}");
    let nic = format!("tap=tap0,mac={mac}");
    let args = [
        "run",
        "--kernel",
        "probe",
        "--cmdline",
        &cmdline,
        "--memory",
        "128M",
        "--exits",
        exits,
        "--net",
        &nic,
        "--replicate-to",
        &url,
        "--secret-file",
        secret.to_str().unwrap(),
        "--epoch",
        EPOCH_MS,
        "--metrics",
        metrics.to_str().unwrap(),
        "--serial",
        &serial,
        "--timeout",
        "60",
    ];
    let _ = std::fs::remove_file(metrics.with_extension("out"));
    (
        start_command(net.primary.command(MUSUBI), &args, None),
        metrics,
    )
}

/// The primary's metrics now (SIGUSR1 has it write them).
fn metrics_now(vm: &Started, path: &Path) -> Option<musubi_types::Metrics> {
    let _ = std::fs::remove_file(path);
    // SAFETY: kill(2) on our own child, not yet waited for.
    unsafe { libc::kill(vm.child.id() as libc::pid_t, libc::SIGUSR1) };
    let mut m = None;
    wait_until(Duration::from_secs(5), || {
        m = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        m.is_some()
    });
    m
}

/// Waits until the standby acknowledged a few epochs; returns the primary's metrics then.
fn wait_protected(vm: &mut Started, path: &Path) -> musubi_types::Metrics {
    // SIGUSR1 ends a musubi that has not set up its handler yet: the guest's first line
    // says it has.
    let serial = path.with_extension("out");
    vm.wait_for_text(&serial, "probe: Musubi probe guest", LIMIT);
    let mut last = None;
    let ok = wait_until(LIMIT, || {
        last = metrics_now(vm, path);
        let r = last.as_ref().and_then(|m| m.replication.as_ref());
        r.is_some_and(|r| r.epochs_acked >= 3) || vm.child.try_wait().ok().flatten().is_some()
    });
    let m = last.expect("the primary's metrics");
    assert!(
        ok && m.replication.as_ref().is_some_and(|r| r.epochs_acked >= 3),
        "the standby acknowledged too few epochs, or the primary ended: {:?}",
        m.replication
    );
    m
}

/// A small xorshift: random kill moments without a crate, the seed printed to replay.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The `udp-counter` client: a request every few ms, resent when no answer comes within
/// 40 ms; every answer is kept with when it came.
struct Counter {
    answers: Arc<Mutex<Vec<(Instant, u64)>>>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Counter {
    fn start(ns: &Netns) -> Counter {
        let answers = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, s) = (answers.clone(), stop.clone());
        let thread = ns.spawn(move || {
            let sock = UdpSocket::bind((CLIENT, 0)).expect("the client binds");
            sock.set_read_timeout(Some(Duration::from_millis(5)))
                .unwrap();
            let t0 = Instant::now();
            let mut buf = [0u8; 64];
            while !s.load(Ordering::SeqCst) && t0.elapsed() < LIMIT {
                let _ = sock.send_to(b"next", (GUEST, COUNTER_PORT));
                let sent = Instant::now();
                let mut got = false;
                while sent.elapsed() < Duration::from_millis(40) {
                    match sock.recv(&mut buf) {
                        Ok(n) => {
                            let v = std::str::from_utf8(&buf[..n])
                                .ok()
                                .and_then(|t| t.parse::<u64>().ok())
                                .unwrap_or_else(|| panic!("not a number: {:?}", &buf[..n]));
                            a.lock().unwrap().push((Instant::now(), v));
                            got = true;
                        }
                        Err(_) if got => break,
                        Err(_) => {}
                    }
                }
                if got {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        });
        Counter {
            answers,
            stop,
            thread,
        }
    }

    fn count(&self) -> usize {
        self.answers.lock().unwrap().len()
    }

    fn stop(self) -> Vec<(Instant, u64)> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().expect("the client thread");
        Arc::try_unwrap(self.answers).unwrap().into_inner().unwrap()
    }
}

/// Waits until `cond`, or the limit; false if it never held.
fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    wait_until(limit, &mut cond)
}

#[test]
fn udp_counter_answers_go_on_from_the_standby_with_none_lost_over_20_kills() {
    let net = Net::new("uc");
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 41);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut rng = Rng(seed);
    eprintln!("kill moments from seed {seed:#x}");
    let mut failovers = Vec::new();
    // Per kill: frames the standby sent for its primary.
    let mut replayed: Vec<u64> = Vec::new();
    // Per kill: answers that came twice.
    let mut repeated: Vec<usize> = Vec::new();
    for round in 0..20u64 {
        // A MAC of its own per round, and a client that asks for it again, so nothing a
        // bridge learned in the round before sends this round's requests astray.
        ip(&["-n", &net.client.name, "neigh", "flush", "all"]);
        let mac = format!("52:54:00:09:00:{:02x}", round + 1);
        let exits = if round % 2 == 0 { "kernel" } else { "user" };
        let port = free_port();
        let standby_serial = dir.path().join(format!("standby{round}.out"));
        let standby = start_standby(&net, port, &key, &standby_serial);
        let standby_guard = KillOnPanic::new(&standby);
        let (mut primary, metrics) = start_primary(
            &net,
            dir.path(),
            port,
            &key,
            &format!("udp-counter={COUNTER_PORT},n=1000000"),
            &mac,
            exits,
        );
        let primary_guard = KillOnPanic::new(&primary);
        let client = Counter::start(&net.client);
        assert!(
            wait_for(LIMIT, || client.count() >= 5),
            "round {round}: the primary never answered"
        );
        wait_protected(&mut primary, &metrics);
        let before_kill = client.count();
        std::thread::sleep(Duration::from_millis(rng.below(300)));
        let killed = Instant::now();
        primary.child.kill().unwrap();
        primary_guard.defuse();
        let p = primary.finish(LIMIT);
        assert_eq!(p.code, None, "round {round}: {}", p.explain());
        let at_kill = client.count();
        let continued = wait_for(Duration::from_secs(20), || client.count() >= at_kill + 30);
        let answers = client.stop();
        // Running the VM now: its metrics show the announcement it made before.
        let announced = continued
            .then(|| metrics_now(&standby, &standby_serial.with_extension("json")))
            .flatten()
            .map(|m| m.net[0].announcements);
        standby_guard.defuse();
        let mut standby = standby;
        let _ = standby.child.kill();
        let s = standby.finish(LIMIT);
        assert!(
            continued,
            "round {round}: answers stopped at {} after the kill ({} before it)\nstandby: {}",
            answers.len(),
            at_kill,
            s.explain()
        );
        assert!(
            s.stderr.contains("taking over from epoch"),
            "round {round}: {}",
            s.explain()
        );
        let sent_for_primary = s
            .stderr
            .split("(replayed ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("round {round}: no replayed count: {}", s.explain()));
        replayed.push(sent_for_primary);
        assert_eq!(
            announced,
            Some(1),
            "round {round}: the standby's gratuitous ARPs"
        );
        let values: Vec<u64> = answers.iter().map(|a| a.1).collect();
        let timeline = || {
            let ms = |d: Duration| d.as_secs_f64() * 1000.0;
            let shown: Vec<String> = answers
                .iter()
                .map(|(t, v)| match t.checked_duration_since(killed) {
                    Some(d) => format!("{v}@+{:.1}ms", ms(d)),
                    None => format!("{v}@-{:.1}ms", ms(killed - *t)),
                })
                .collect();
            format!(
                "round {round} ({exits} exits, {at_kill} answers at the kill): {}\nstandby: {}",
                shown.join(" "),
                s.explain()
            )
        };
        assert_eq!(values.first(), Some(&1), "{}", timeline());
        assert!(
            values.windows(2).all(|w| w[1] >= w[0]),
            "a number went back: {}",
            timeline()
        );
        // A repeat is only the window the module's doc names: the primary wrote the frame
        // and died before saying so, and the standby sent it again.
        let repeats: Vec<&(Instant, u64)> = answers
            .windows(2)
            .filter(|w| w[1].1 == w[0].1)
            .map(|w| &w[1])
            .collect();
        assert!(
            repeats.len() as u64 <= sent_for_primary && repeats.iter().all(|a| a.0 > killed),
            "a number repeated other than by the standby sending the primary's last frames \
             again ({sent_for_primary} sent for it): {}",
            timeline()
        );
        repeated.push(repeats.len());
        // None lost: the frames of the epoch the standby resumed from went out from the
        // primary or, if it died before saying so, from the standby.
        assert!(
            values.windows(2).all(|w| w[1] <= w[0] + 1),
            "a number skipped ({sent_for_primary} frames sent for the primary): {}",
            timeline()
        );
        let first_after = answers
            .iter()
            .find(|a| a.0 > killed)
            .map(|a| a.0 - killed)
            .expect("an answer after the kill");
        eprintln!(
            "round {round} ({exits} exits): {} answers ({before_kill} before protection's wait ended, {at_kill} at the kill), {sent_for_primary} frames sent by the standby for its primary, first answer {:?} after the kill",
            values.len(),
            first_after
        );
        failovers.push(first_after);
    }
    failovers.sort();
    eprintln!(
        "20 kills, no answer lost; the standby sent frames for its primary after {} kills ({replayed:?}), an answer came twice after {} ({repeated:?}); kill to first answer: median {:?}, max {:?}",
        replayed.iter().filter(|&&n| n > 0).count(),
        repeated.iter().filter(|&&n| n > 0).count(),
        failovers[failovers.len() / 2],
        failovers.last().unwrap()
    );
}

#[test]
fn a_tcp_stream_from_the_guest_arrives_whole_and_in_order_across_a_failover() {
    let net = Net::new("tc");
    let dir = tempfile::tempdir().unwrap();
    let key = secret_file(dir.path(), "secret", 42);
    let bytes: u64 = 16 << 20;
    let received = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let got = received.clone();
    let sink = net.client.spawn(move || {
        let l = TcpListener::bind((CLIENT, SINK_PORT)).unwrap();
        l.set_nonblocking(true).unwrap();
        let t0 = Instant::now();
        let mut s = loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(_) if t0.elapsed() < LIMIT => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => panic!("the guest never connected: {e}"),
            }
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(LIMIT)).unwrap();
        let (mut total, mut buf) = (0u64, vec![0u8; 65536]);
        loop {
            let n = s.read(&mut buf).expect("the stream ends with a close");
            if n == 0 {
                break;
            }
            for (i, &b) in buf[..n].iter().enumerate() {
                let at = total + i as u64;
                assert_eq!(b, (at % 251) as u8, "byte {at} of the stream");
            }
            total += n as u64;
            got.store(total, Ordering::SeqCst);
        }
        total
    });
    let port = free_port();
    let standby_serial = dir.path().join("standby.out");
    let standby = start_standby(&net, port, &key, &standby_serial);
    let standby_guard = KillOnPanic::new(&standby);
    let (mut primary, metrics) = start_primary(
        &net,
        dir.path(),
        port,
        &key,
        // fib first: the stream starts once the VM is protected, its output held.
        &format!("fib=44,tcp-send={CLIENT}:{SINK_PORT},bytes={bytes}"),
        "52:54:00:09:01:01",
        "kernel",
    );
    let primary_guard = KillOnPanic::new(&primary);
    let m = wait_protected(&mut primary, &metrics);
    assert!(
        wait_for(LIMIT, || received.load(Ordering::SeqCst) >= 1 << 20),
        "the sink got {} bytes before the kill",
        received.load(Ordering::SeqCst)
    );
    let m2 = metrics_now(&primary, &metrics).expect("the primary's metrics");
    let c = &m2.net[0];
    assert!(
        c.tx_held > 0 && c.tx_released > 0 && c.tx_released <= c.tx_held,
        "the primary held and released its output: {c:?}"
    );
    let at_kill = received.load(Ordering::SeqCst);
    assert!(at_kill < bytes, "the stream ended before the kill");
    primary.child.kill().unwrap();
    primary_guard.defuse();
    let p = primary.finish(LIMIT);
    assert_eq!(p.code, None, "{}", p.explain());
    standby_guard.defuse();
    let s = standby.finish(LIMIT);
    let text = read_text(&standby_serial);
    assert_eq!(s.code, Some(0), "{}\nconsole:\n{text}", s.explain());
    let total = sink.join().expect("the sink read the stream in order");
    let sm: musubi_types::Metrics =
        serde_json::from_str(&read_text(&standby_serial.with_extension("json"))).unwrap();
    assert_eq!(
        sm.net[0].announcements, 1,
        "the standby announced the guest before it ran: {:?}",
        sm.net[0]
    );
    assert!(
        sm.net[0].tx_held == 0,
        "the standby holds nothing: {:?}",
        sm.net[0]
    );
    assert_eq!(total, bytes, "bytes the sink read ({at_kill} at the kill)");
    assert_eq!(result_in(&text, "tcp-send")["bytes"], bytes, "{text}");
    eprintln!(
        "tcp-send: {at_kill} of {bytes} bytes at the kill; the primary had held {} frames, epochs acked {:?}",
        c.tx_held,
        m.replication.map(|r| r.epochs_acked)
    );
}
