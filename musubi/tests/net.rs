//! virtio-net over TAP, end to end: the probe guest's network tasks against peers on the
//! host side of the TAP. Every test makes a network namespace of its own; the VMM runs in
//! it, creates its TAP there, and the peers are threads that entered it, so no traffic
//! leaves the namespace and nothing is added to the host's own.

mod common;
use common::netns::Netns;
use common::*;
use musubi_types::Metrics;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const HOST: &str = "10.0.0.1";
const GUEST: &str = "10.0.0.2";
/// Every guest test's limit: what a loaded machine needs to boot the probe and move a few
/// hundred packets through its emulated kernel path, with room to spare.
const LIMIT: Duration = Duration::from_secs(120);

/// `musubi run` of the probe with a TAP named `tap0` in `ns`, its host end `10.0.0.1/24`.
fn run_in(ns: &Netns, tasks: &str, exits: &str, extra: &[&str]) -> Started {
    run_with_net(ns, tasks, exits, "", extra)
}

/// `run_in` with `more` (`,key=value...`) added to the `--net` spec.
fn run_with_net(ns: &Netns, tasks: &str, exits: &str, more: &str, extra: &[&str]) -> Started {
    let net = format!("tap=tap0,ip=10.0.0.1,mask=255.255.255.0{more}");
    let cmdline = format!("probe.ip={GUEST}/24 probe.tasks={tasks}");
    let mut args = vec!["--exits", exits];
    args.extend_from_slice(extra);
    run_probe(ns.command(MUSUBI), &cmdline, &net, &args)
}

/// `cmd` (`musubi`, wherever it runs) running the probe of 128 MiB with `cmdline` and
/// `--net net`, and `extra` flags.
fn run_probe(cmd: std::process::Command, cmdline: &str, net: &str, extra: &[&str]) -> Started {
    let mut args = vec![
        "run",
        "--kernel",
        "probe",
        "--cmdline",
        cmdline,
        "--memory",
        "128M",
        "--net",
        net,
    ];
    args.extend_from_slice(extra);
    start_command(cmd, &args, None)
}

/// A UDP echo server in `ns` that answers until the guest has been quiet for 5 s after
/// its traffic began, or the limit; `answered` counts as it goes.
fn udp_echo(ns: &Netns, port: u16, answered: Arc<AtomicU64>) -> std::thread::JoinHandle<u64> {
    ns.spawn(move || {
        let s = UdpSocket::bind(("0.0.0.0", port)).expect("echo binds");
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let t0 = Instant::now();
        let mut buf = [0u8; 2048];
        let mut idle_since = None::<Instant>;
        while t0.elapsed() < LIMIT {
            match s.recv_from(&mut buf) {
                Ok((n, from)) => {
                    // The guest may be gone with its TAP: a failed answer is its loss.
                    let _ = s.send_to(&buf[..n], from);
                    answered.fetch_add(1, Ordering::Relaxed);
                    idle_since = None;
                }
                Err(_) => {
                    let since = *idle_since.get_or_insert_with(Instant::now);
                    if answered.load(Ordering::Relaxed) > 0
                        && since.elapsed() > Duration::from_secs(5)
                    {
                        break;
                    }
                }
            }
        }
        answered.load(Ordering::Relaxed)
    })
}

fn metrics_in(path: &std::path::Path) -> Metrics {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn udp_echo_runs(exits: &str) {
    udp_echo_runs_with(exits, "", &format!("udp{}", &exits[..1]));
}

fn udp_echo_runs_with(exits: &str, more: &str, ns_name: &str) {
    let ns = Netns::new(ns_name);
    let echo = udp_echo(&ns, 7777, Arc::default());
    let metrics = tempfile::NamedTempFile::new().unwrap();
    let m = metrics.path().display().to_string();
    let vm = run_with_net(
        &ns,
        &format!("udp-echo={HOST}:7777,n=200"),
        exits,
        more,
        &["--metrics", &m],
    );
    let run = vm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    let r = run.result("udp-echo");
    assert_eq!(r["rounds"], 200, "{r}");
    assert_eq!(r["lost"], 0, "a TAP inside one host loses nothing: {r}");
    let answered = echo.join().unwrap();
    assert!(answered >= 200, "the echo answered {answered} of 200");
    let metrics = metrics_in(metrics.path());
    let net = &metrics.net[0];
    assert!(net.tx_packets >= 200 && net.rx_packets >= 200, "{metrics}");
    assert!(!ns.has_link("tap0"), "the TAP musubi made went with it");
}

#[test]
fn udp_echo_over_a_tap_on_the_kernel_exit_path() {
    udp_echo_runs("kernel");
}

#[test]
fn udp_echo_over_a_tap_on_the_user_exit_path() {
    udp_echo_runs("user");
}

/// A TAP of four queues under a driver that uses one pair (the probe's takes no MQ): the
/// queues of the pairs not in use are detached, so the kernel sends every frame to the one
/// the guest reads and nothing is lost. The device's nine doorbells are ioeventfds here.
#[test]
fn udp_echo_over_a_multiqueue_tap_whose_guest_uses_one_pair() {
    udp_echo_runs_with("kernel", ",num_queues=8", "udpmq");
}

/// The same with every doorbell an MMIO exit served on the vCPU thread, the four TAP
/// queues still watched by the I/O thread.
#[test]
fn udp_echo_over_a_multiqueue_tap_on_the_user_exit_path() {
    udp_echo_runs_with("user", ",num_queues=8", "udpmqu");
}

/// GETs `paths` from the guest's HTTP server, from a thread in `ns`, once it listens.
fn http_get_all(ns: &Netns, paths: &'static [&'static str]) -> Vec<(&'static str, String)> {
    ns.spawn(move || {
        let addr: SocketAddr = format!("{GUEST}:8080").parse().unwrap();
        let t0 = Instant::now();
        let mut answers = Vec::new();
        for &path in paths {
            let mut s = loop {
                match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                    Ok(s) => break s,
                    Err(e) => {
                        assert!(t0.elapsed() < LIMIT, "the guest never listened: {e}");
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
            };
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: {GUEST}\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut answer = String::new();
            s.read_to_string(&mut answer).unwrap();
            answers.push((path, answer));
        }
        answers
    })
    .join()
    .unwrap()
}

fn serves_http(tag: &str, extra: &[&str]) {
    let ns = Netns::new(tag);
    let paths: &[&str] = &["/x", "/musubi/net"];
    let vm = run_in(&ns, "http-serve=8080,n=2", "kernel", extra);
    let guard = KillOnPanic::new(&vm);
    let answers = http_get_all(&ns, paths);
    let run = vm.finish(LIMIT);
    guard.defuse();
    for (path, answer) in &answers {
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer:?}");
        let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
        assert!(body.contains(path), "{path}: {answer:?}");
    }
    assert_eq!(run.code, Some(0), "{}", run.explain());
    assert_eq!(run.result("http-serve")["served"], 2);
}

#[test]
fn the_guest_serves_http_to_a_client_on_the_host_side() {
    serves_http("http", &[]);
}

/// The device lives on the node that holds the devices; the other node's accesses to it
/// and its interrupts are forwarded.
#[test]
fn a_vm_over_two_nodes_serves_http_from_its_io_node() {
    serves_http("http2", &["--nodes", "2", "--cpus", "2"]);
}

/// A TCP sink on `port` in `ns` that checks every byte (byte i of the stream is i mod 251,
/// as the probe's `tcp-send` sends it): the bytes it read before the close.
fn checked_sink(ns: &Netns, port: u16) -> std::thread::JoinHandle<u64> {
    ns.spawn(move || {
        let l = TcpListener::bind(("0.0.0.0", port)).unwrap();
        l.set_nonblocking(true).unwrap();
        let t0 = Instant::now();
        let mut s = loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(_) if t0.elapsed() < LIMIT => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => panic!("the guest never connected: {e}"),
            }
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let (mut total, mut buf) = (0u64, vec![0u8; 65536]);
        loop {
            let n = s.read(&mut buf).expect("the stream ends with a close");
            if n == 0 {
                break;
            }
            if let Some(i) = (0..n).find(|&i| buf[i] as u64 != (total + i as u64) % 251) {
                panic!("the stream is corrupt at byte {}", total + i as u64);
            }
            total += n as u64;
        }
        total
    })
}

/// Bytes of the checked streams.
const CHECKED_BYTES: u64 = 4 << 20;

/// `tcp-send` of `CHECKED_BYTES` to a `checked_sink` in a namespace of its own; the task's
/// result line.
fn tcp_stream_checked(tag: &str, exits: &str, cmdline_more: &str) -> serde_json::Value {
    let ns = Netns::new(tag);
    let sink = checked_sink(&ns, 9000);
    let vm = run_in(
        &ns,
        &format!("tcp-send={HOST}:9000,bytes={CHECKED_BYTES}{cmdline_more}"),
        exits,
        &[],
    );
    let run = vm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    let total = sink.join().unwrap();
    assert_eq!(total, CHECKED_BYTES, "bytes the sink read");
    let r = run.result("tcp-send");
    assert_eq!(r["bytes"], CHECKED_BYTES, "{r}");
    r
}

/// A namespace's TCP checksum errors (`InCsumErrors` of `/proc/net/snmp`).
fn tcp_checksum_errors(ns: &Netns) -> u64 {
    let out = ns.command("cat").arg("/proc/net/snmp").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut tcp = text.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next().unwrap_or(""), tcp.next().unwrap_or(""));
    let at = names.split_whitespace().position(|n| n == "InCsumErrors");
    at.and_then(|i| values.split_whitespace().nth(i))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no InCsumErrors in /proc/net/snmp:\n{text}"))
}

/// Everywhere else the host delivers the guest's large frames whole and trusts the
/// checksums the guest left to it. Here they leave the VM's namespace through a veth that
/// takes neither segmentation nor checksums, into a client namespace that checks every
/// checksum it receives: the host cuts each frame at the guest's MSS and finishes each
/// segment's checksum from the pseudo-header sum the guest wrote, and one wrong sum would
/// be a dropped segment, a stalled stream and a counted checksum error.
#[test]
fn large_frames_cut_and_checksummed_by_the_host_arrive_whole_and_verified() {
    let net = testkit::replica_net::ReplicaNet::new("swcsum");
    net.primary
        .checksum_in_software("vp")
        .expect("turning the primary's veth offloads off");
    net.client
        .checksum_in_software("vpc")
        .expect("turning the client's veth offloads off");
    let sink = checked_sink(&net.client, 9000);
    let cmdline = format!(
        "probe.ip={}/24 probe.tasks=tcp-send={}:9000,bytes={CHECKED_BYTES}",
        testkit::replica_net::GUEST,
        testkit::replica_net::CLIENT
    );
    let run = run_probe(net.primary.command(MUSUBI), &cmdline, "tap=tap0", &[]).finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    assert_eq!(sink.join().unwrap(), CHECKED_BYTES, "bytes the client read");
    let r = run.result("tcp-send");
    let (frames, segs) = (r["tso_frames"].as_u64(), r["tso_segments"].as_u64());
    assert!(
        frames > Some(0) && segs > frames,
        "the guest left no frame to the host to cut: {r}"
    );
    assert_eq!(tcp_checksum_errors(&net.client), 0, "checksum errors");
}

#[test]
fn a_tcp_stream_from_the_guest_arrives_whole_in_tso_frames() {
    let r = tcp_stream_checked("tso", "kernel", "");
    // The stack built segments of many MSS each, the device cut them (HOST_TSO4), and most
    // of the stream went so.
    let (frames, segs) = (r["tso_frames"].as_u64(), r["tso_segments"].as_u64());
    let (Some(frames), Some(segs)) = (frames, segs) else {
        panic!("the guest sent no TSO frames: {r}")
    };
    let mss_segments = CHECKED_BYTES.div_ceil(1460);
    assert!(
        frames > 0 && segs >= 2 * frames && segs * 2 > mss_segments,
        "{frames} TSO frames of {segs} segments, of {mss_segments}: {r}"
    );
}

#[test]
fn a_tcp_stream_without_tso_arrives_whole_on_the_user_exit_path() {
    let r = tcp_stream_checked("notso", "user", " probe.net_tso=0");
    assert!(
        r["tso_frames"].is_null(),
        "probe.net_tso=0 took no TSO: {r}"
    );
}

#[test]
fn a_tcp_stream_in_tso_frames_arrives_whole_on_the_user_exit_path() {
    let r = tcp_stream_checked("tsou", "user", "");
    assert!(r["tso_frames"].as_u64() > Some(0), "{r}");
}

#[test]
fn the_io_threads_poll_window_catches_the_echo_and_its_requests_without_doorbells() {
    let ns = Netns::new("poll");
    let echo = udp_echo(&ns, 7777, Arc::default());
    let metrics = tempfile::NamedTempFile::new().unwrap();
    let m = metrics.path().display().to_string();
    let vm = run_in(
        &ns,
        &format!("udp-echo={HOST}:7777,n=200"),
        "kernel",
        // Longer than a round trip on a loaded host, so most events are caught polling, and
        // held to its end while the tests running beside this one wait for a CPU.
        &["--metrics", &m, "--io-poll", "5ms", "--io-poll-hold"],
    );
    let run = vm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    assert_eq!(run.result("udp-echo")["rounds"], 200);
    assert!(echo.join().unwrap() >= 200);
    let io = metrics_in(metrics.path())
        .io_thread
        .expect("the I/O thread's counts");
    assert_eq!(io.poll_us, 5000, "{io:?}");
    // 200 rounds are 400 events at least; a sleep ends only where a window ran out.
    assert!(io.poll_hits >= 200 && io.poll_hits > io.wakeups, "{io:?}");
    assert!(io.wakeups <= io.poll_misses + 1, "{io:?}");
    assert!(io.poll_ns > 0 && io.cpu_ns > 0, "{io:?}");
    assert_eq!(io.poll_yields, 0, "a held window gives up nothing: {io:?}");
    // The requests are found on the transmit ring, with its doorbell off while the thread
    // polls: most rounds cost the guest no doorbell, and no exit.
    let kicks = run.result("udp-echo")["kicks"].as_u64().unwrap();
    assert!(
        io.ring_hits >= 100 && kicks < 100,
        "{kicks} doorbells, {io:?}"
    );
}

/// A TCP sink in `ns` on `port` that takes `conns` connections and reads each to its
/// end at once; returns the bytes of each, in the order they were accepted.
fn tcp_sink(ns: &Netns, port: u16, conns: usize) -> std::thread::JoinHandle<Vec<u64>> {
    ns.spawn(move || {
        let l = TcpListener::bind(("0.0.0.0", port)).unwrap();
        l.set_nonblocking(true).unwrap();
        let t0 = Instant::now();
        let mut readers = Vec::new();
        while readers.len() < conns {
            match l.accept() {
                Ok((mut s, _)) => readers.push(std::thread::spawn(move || {
                    s.set_nonblocking(false).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                    let (mut total, mut buf) = (0u64, vec![0u8; 65536]);
                    loop {
                        let n = s.read(&mut buf).expect("the stream ends with a close");
                        if n == 0 {
                            break total;
                        }
                        total += n as u64;
                    }
                })),
                Err(_) if t0.elapsed() < LIMIT => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => panic!(
                    "the guest made {} of {conns} connections: {e}",
                    readers.len()
                ),
            }
        }
        readers.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

#[test]
fn a_tcp_stream_from_an_application_processor_uses_that_cpus_pair() {
    let ns = Netns::new("tcpap");
    let sink = tcp_sink(&ns, 9000, 1);
    let bytes = 256 << 10;
    let vm = run_in(
        &ns,
        &format!("tcp-send={HOST}:9000,bytes={bytes},cpu=1"),
        "kernel",
        &["--cpus", "2"],
    );
    let run = vm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    assert_eq!(sink.join().unwrap(), vec![bytes], "bytes the sink read");
    let r = run.result("tcp-send");
    assert_eq!(r["bytes"], bytes);
    // A single-pair device (no VIRTIO_NET_F_MQ): CPU 1's pair is 1 mod 1.
    assert_eq!(r["queue_pairs"], 1, "{r}");
    assert_eq!(r["queue_pair"], 0, "{r}");
}

#[test]
fn two_udp_echo_copies_on_two_cpus_each_use_a_queue_pair_of_their_own() {
    let ns = Netns::new("udpmq2");
    let answered = Arc::new(AtomicU64::new(0));
    let echo = udp_echo(&ns, 7777, answered);
    let vm = run_with_net(
        &ns,
        &format!("udp-echo={HOST}:7777,n=100,procs=2"),
        "kernel",
        ",num_queues=4",
        &["--cpus", "2"],
    );
    let run = vm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    let r = run.result("udp-echo");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["queue_pairs"], 2, "{r}");
    assert_eq!(
        r["answered"], 200,
        "a TAP inside one host loses nothing: {r}"
    );
    for (i, c) in r["copies"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c["queue_pair"], i, "copy {i} drives pair {i}: {r}");
        assert_eq!(c["rounds"], 100, "{r}");
    }
    assert!(echo.join().unwrap() >= 200, "the echo answered both copies");
}

/// `tcp-send` of `bytes` with the task's further words `more` (`cpu=`, `procs=`, other
/// `probe.` words) in a 2-vCPU VM whose device has two queue pairs, to a sink taking
/// `conns` connections; it must end cleanly. The result line, the bytes the sink read on
/// each connection and the device's counters.
fn mq_tcp_send(
    tag: &str,
    bytes: u64,
    more: &str,
    conns: usize,
) -> (serde_json::Value, Vec<u64>, musubi_types::NetCounters) {
    let (r, read, metrics) = mq_tcp_send_with(tag, bytes, more, conns, &[]);
    (r, read, metrics.net[0])
}

/// As [`mq_tcp_send`], with `extra` flags for `run`; the whole `--metrics`.
fn mq_tcp_send_with(
    tag: &str,
    bytes: u64,
    more: &str,
    conns: usize,
    extra: &[&str],
) -> (serde_json::Value, Vec<u64>, Metrics) {
    let ns = Netns::new(tag);
    let sink = tcp_sink(&ns, 9000, conns);
    let metrics = tempfile::NamedTempFile::new().unwrap();
    let m = metrics.path().display().to_string();
    let mut flags = vec!["--cpus", "2", "--metrics", &m];
    flags.extend_from_slice(extra);
    let vm = run_with_net(
        &ns,
        &format!("tcp-send={HOST}:9000,bytes={bytes}{more}"),
        "kernel",
        ",num_queues=4",
        &flags,
    );
    let run = vm.finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    let read = sink.join().unwrap();
    (run.result("tcp-send"), read, metrics_in(metrics.path()))
}

#[test]
fn a_refused_vq_pairs_set_leaves_the_guest_on_one_pair_and_says_so() {
    let bytes = 256 << 10;
    // Three pairs of a device that has two: the device must answer VIRTIO_NET_ERR.
    let (r, read, net) = mq_tcp_send("tcpmqerr", bytes, ",cpu=1 probe.net_pairs=3", 1);
    assert_eq!(read, vec![bytes], "bytes the sink read");
    assert_eq!(r["queue_pairs"], 1, "{r}");
    assert_eq!(r["queue_pair"], 0, "{r}");
    assert_eq!(r["mq_error"], "VQ_PAIRS_SET answered ERR", "{r}");
    assert_eq!(net.ctrl_errors, 1, "{net:?}");
}

#[test]
fn a_tcp_stream_from_cpu_1_uses_pair_1_of_a_multiqueue_device() {
    let bytes = 256 << 10;
    let (r, read, _) = mq_tcp_send("tcpmqap", bytes, ",cpu=1", 1);
    assert_eq!(read, vec![bytes], "bytes the sink read");
    assert_eq!(r["queue_pairs"], 2, "{r}");
    assert_eq!(r["max_queue_pairs"], 2, "{r}");
    assert_eq!(r["queue_pair"], 1, "{r}");
}

/// As an orchestrator does (Cloud Hypervisor's `fds`, QEMU's `fds=`): the test opens two
/// queues of a multiqueue TAP and hands them down as `fd=A:B`; each of the guest's two
/// streams goes out through the pair, and so the descriptor, of its own.
#[test]
fn two_streams_go_out_through_two_handed_over_tap_queues() {
    use std::os::unix::process::CommandExt;
    let ns = Netns::new("mqfd");
    let taps = ns
        .spawn(|| devices::net::tap::Tap::open_queues("mqfd0", 2))
        .join()
        .unwrap()
        .expect("a multiqueue TAP of two queues");
    for args in [
        ["addr", "add", "10.0.0.1/24", "dev", "mqfd0"].as_slice(),
        ["link", "set", "mqfd0", "up"].as_slice(),
    ] {
        let mut a = vec!["-n", ns.name.as_str()];
        a.extend_from_slice(args);
        common::netns::ip(&a);
    }
    let fds: Vec<i32> = taps.iter().map(|t| t.as_raw_fd()).collect();
    let bytes = 1u64 << 20;
    let sink = tcp_sink(&ns, 9000, 2);
    let cmdline =
        format!("probe.ip={GUEST}/24 probe.tasks=tcp-send={HOST}:9000,bytes={bytes},procs=2");
    let net = format!("fd={}:{}", fds[0], fds[1]);
    let mut cmd = ns.command(MUSUBI);
    // SAFETY: the closure runs in the child between fork and exec and calls only fcntl,
    // which is async-signal-safe, on descriptors the parent holds open.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let run = run_probe(cmd, &cmdline, &net, &["--cpus", "2"]).finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.explain());
    assert_eq!(
        sink.join().unwrap(),
        vec![bytes, bytes],
        "bytes the sink read"
    );
    let r = run.result("tcp-send");
    assert_eq!(r["queue_pairs"], 2, "{r}");
    let copies = r["copies"].as_array().unwrap();
    for (i, c) in copies.iter().enumerate() {
        assert_eq!(c["queue_pair"], i, "copy {i} drives pair {i}: {r}");
        assert_eq!(c["bytes"], bytes, "{r}");
    }
    drop(taps);
}

#[test]
fn more_copies_than_the_device_has_pairs_are_refused_naming_the_pairs() {
    let ns = Netns::new("tcpmq1");
    let vm = run_in(
        &ns,
        &format!("tcp-send={HOST}:9000,bytes=4096,procs=2"),
        "kernel",
        &["--cpus", "2"],
    );
    let run = vm.finish(LIMIT);
    assert_eq!(run.code, Some(7), "{}", run.explain());
    let r = run.result("tcp-send");
    assert_eq!(r["ok"], false, "{r}");
    assert_eq!(r["queue_pairs"], 1, "{r}");
    assert!(r["error"].as_str().unwrap().contains("queue pairs"), "{r}");
}

#[test]
fn two_tcp_streams_from_two_cpus_each_use_a_queue_pair_of_their_own() {
    let bytes = 1 << 20;
    let (r, read, net) = mq_tcp_send("tcpmq2", bytes, ",procs=2", 2);
    assert_eq!(read, vec![bytes, bytes], "bytes the sink read");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["queue_pairs"], 2, "VQ_PAIRS_SET(2) was taken: {r}");
    assert_eq!(r["bytes"], 2 * bytes, "{r}");
    let copies = r["copies"].as_array().unwrap();
    assert_eq!(copies.len(), 2, "{r}");
    for (i, c) in copies.iter().enumerate() {
        assert_eq!(c["cpu"], i, "{r}");
        assert_eq!(c["queue_pair"], i, "copy {i} drives pair {i}: {r}");
        assert_eq!(c["bytes"], bytes, "{r}");
        // Each copy's flow came back on its own pair: the host acknowledged its bytes there.
        assert!(c["rx_packets"].as_u64().unwrap() > 0, "{r}");
    }
    assert_ne!(copies[0]["local_port"], copies[1]["local_port"], "{r}");
    assert!(
        net.ctrl_commands >= 1,
        "the guest sent VQ_PAIRS_SET: {net:?}"
    );
    assert_eq!(net.ctrl_errors, 0, "{net:?}");
}

#[test]
fn two_tcp_streams_on_two_io_threads_are_each_served_by_their_pairs_thread() {
    let bytes = 1 << 20;
    let (r, read, m) = mq_tcp_send_with("tcpio2", bytes, ",procs=2", 2, &["--io-threads", "2"]);
    assert_eq!(read, vec![bytes, bytes], "bytes the sink read");
    assert_eq!(r["queue_pairs"], 2, "{r}");
    let threads = &m.io_threads;
    assert_eq!(threads.len(), 2, "a thread per pair: {threads:?}");
    for (k, t) in threads.iter().enumerate() {
        // Thread 1 has nothing but pair 1's doorbells and TAP queue: anything it took
        // was that pair's.
        assert!(
            t.wakeups + t.poll_hits > 0,
            "thread {k} served nothing: {threads:?}"
        );
        assert!(t.cpu_ns > 0, "{threads:?}");
    }
    let total = m.io_thread.expect("the threads' sum");
    assert_eq!(
        total.wakeups,
        threads.iter().map(|t| t.wakeups).sum::<u64>()
    );
}

#[test]
fn bad_net_flags_are_refused_naming_the_flag() {
    for (spec, why) in [
        ("tap=much-too-long-a-name", "1 to 15 bytes"),
        ("ip=10.0.0.1", "give tap=NAME or fd=N"),
        ("fd=250", "descriptor 250 is not open"),
        ("tap=t,queue_size=3", "power of two"),
        ("tap=t0 --net tap=t0", "--net tap=t0 is given twice"),
        ("tap=t,num_queues=3", "num_queues=3 must be an even number"),
        ("fd=250,num_queues=4", "num_queues=4 with fd="),
    ] {
        let mut args = vec!["run", "--kernel", "probe"];
        for one in spec.split(" --net ") {
            args.extend(["--net", one]);
        }
        let run = run(&args);
        assert_ne!(run.code, Some(0), "{spec}");
        assert!(
            run.stderr.contains("--net") && run.stderr.contains(why),
            "{spec}: {}",
            run.stderr
        );
    }
}

#[test]
fn a_tap_that_vanishes_mid_run_costs_packets_not_the_vmm() {
    let ns = Netns::new("gone");
    let answered = Arc::new(AtomicU64::new(0));
    let echo = udp_echo(&ns, 7777, answered.clone());
    let metrics = tempfile::NamedTempFile::new().unwrap();
    let m = metrics.path().display().to_string();
    let vm = run_in(
        &ns,
        // Rounds enough to outlast the TAP; the task's own time limit ends it.
        &format!("udp-echo={HOST}:7777,n=1000000 probe.task_timeout=20"),
        "kernel",
        &["--metrics", &m],
    );
    let guard = KillOnPanic::new(&vm);
    let t0 = Instant::now();
    while answered.load(Ordering::Relaxed) < 20 {
        assert!(t0.elapsed() < LIMIT, "the guest never reached the echo");
        std::thread::sleep(Duration::from_millis(20));
    }
    common::netns::ip(&["-n", &ns.name, "link", "delete", "tap0"]);
    let run = vm.finish(LIMIT);
    guard.defuse();
    echo.join().unwrap();
    assert!(!run.stderr.contains("panicked"), "{}", run.explain());
    // The guest's task runs out of time (status 7, a network task that could not finish)
    // and the guest ends the VM: the VMM neither crashed (125, 126) nor hung.
    assert_eq!(run.code, Some(7), "{}", run.explain());
    let net = &metrics_in(metrics.path()).net[0];
    assert!(
        net.tx_drops > 0,
        "sends to a TAP that is gone are drops: {net}"
    );
}

/// A VM with a network device snapshotted while it serves, ended, and restored: the TAP is
/// made again by name with its address, the guest keeps the MAC it read (a made-up one is
/// saved), and the served connection count goes on from where it was.
#[test]
fn a_snapshot_restores_the_network_device_with_its_mac() {
    snapshot_restores_net("snap", "", &[]);
}

/// The same with a TAP of two queue pairs: the device's five queues are saved and
/// restored, and the TAP is made again with as many queues.
#[test]
fn a_snapshot_restores_a_network_device_of_two_queue_pairs() {
    // A thread per pair: the snapshot's pause parks both.
    let saved = snapshot_restores_net("snapmq", ",num_queues=4", &["--io-threads", "2"]);
    assert_eq!(saved["net"][0]["num_queues"], 4, "{saved}");
}

/// Runs, snapshots and restores a VM whose `--net` spec has `more` added, with `extra`
/// flags for both `run`s; returns the saved configuration.
fn snapshot_restores_net(tag: &str, more: &str, extra: &[&str]) -> serde_json::Value {
    let ns = Netns::new(tag);
    let net = format!("tap=tap0,ip=10.0.0.1,mask=255.255.255.0{more}");
    let dir = tempfile::tempdir().unwrap();
    let (socket, serial) = (dir.path().join("api.sock"), dir.path().join("out"));
    let snap = dir.path().join("snap");
    let serial_arg = format!("file={}", serial.display());
    let cmdline = format!("probe.ip={GUEST}/24 probe.tasks=http-serve=8080,n=2");
    let mut args = vec![
        "run",
        "--kernel",
        "probe",
        "--memory",
        "128M",
        "--cmdline",
        &cmdline,
        "--net",
        &net,
        "--api-socket",
        socket.to_str().unwrap(),
        "--serial",
        &serial_arg,
    ];
    args.extend_from_slice(extra);
    let vm = start_command(ns.command(MUSUBI), &args, None);
    let guard = KillOnPanic::new(&vm);
    let before = http_get_all(&ns, &["/before"]);
    assert!(before[0].1.contains("musubi probe: /before"), "{before:?}");
    remote_json(&socket, &["snapshot", snap.to_str().unwrap()]);
    remote_json(&socket, &["shutdown"]);
    let first = vm.finish(LIMIT);
    guard.defuse();
    assert!(!first.stderr.contains("panicked"), "{}", first.explain());
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(snap.join("config.json")).unwrap()).unwrap();
    let mac = saved["net"][0]["mac"]
        .as_str()
        .expect("the made-up MAC is saved")
        .to_string();

    let serial2 = dir.path().join("out2");
    let serial2_arg = format!("file={}", serial2.display());
    let mut args = vec![
        "run",
        "--restore",
        snap.to_str().unwrap(),
        "--serial",
        &serial2_arg,
    ];
    args.extend_from_slice(extra);
    let restored = start_command(ns.command(MUSUBI), &args, None);
    let guard = KillOnPanic::new(&restored);
    let after = http_get_all(&ns, &["/after"]);
    let run = restored.finish(LIMIT);
    guard.defuse();
    assert!(after[0].1.contains("musubi probe: /after"), "{after:?}");
    assert_eq!(run.code, Some(0), "{}", run.explain());
    let text = read_text(&serial2);
    let r = result_in(&text, "http-serve");
    assert_eq!(
        r["served"], 2,
        "one request before the snapshot, one after: {r}"
    );
    assert_eq!(r["mac"], mac.as_str(), "the guest's MAC is the saved one");
    saved
}

/// How one connection of the flood ends.
#[derive(Clone, Copy)]
enum Leave {
    /// Connected, then closed with a reset (SO_LINGER 0).
    Reset,
    /// Connected, then closed with a FIN, no request sent.
    Close,
    /// Closed before the handshake finished: the guest's SYN-ACK meets a reset, or nothing.
    MidHandshake,
}

/// A non-blocking TCP socket with a connect to `to` under way.
fn start_connect(to: std::net::SocketAddrV4) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: socket(2) with constant arguments; the descriptor is owned at once below.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nothing else owns.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let sa = sockaddr_in(to);
    // SAFETY: `sa` is a valid sockaddr_in of the length passed; a non-blocking connect
    // returns at once (EINPROGRESS).
    unsafe {
        libc::connect(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &sa as *const libc::sockaddr_in as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    fd
}

fn sockaddr_in(a: std::net::SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// Closes `fd` the way `how` says; a socket whose connect has not finished is just closed.
fn leave(fd: std::os::fd::OwnedFd, how: Leave) -> bool {
    let s = TcpStream::from(fd);
    let connected = s.peer_addr().is_ok();
    if connected {
        if let Leave::Reset = how {
            let l = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            // SAFETY: setsockopt(2) on an open socket with a linger of the length passed.
            unsafe {
                libc::setsockopt(
                    std::os::fd::AsRawFd::as_raw_fd(&s),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    &l as *const libc::linger as *const libc::c_void,
                    std::mem::size_of::<libc::linger>() as libc::socklen_t,
                )
            };
        }
    }
    drop(s);
    connected
}

/// The one's-complement sum of `b` as 16-bit big-endian words, folded.
fn csum(b: &[u8], mut sum: u32) -> u16 {
    for w in b.chunks(2) {
        sum += u32::from(w[0]) << 8 | u32::from(*w.get(1).unwrap_or(&0));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Sends `n` SYNs to `to` from addresses of the TAP's subnet that nobody holds, through a
/// raw socket: the guest's SYN-ACKs wait for ARP answers that never come, so each SYN
/// leaves a half-open connection whose client has vanished.
fn spoofed_syns(to: std::net::SocketAddrV4, n: u16) {
    // SAFETY: socket(2) with constant arguments (IPPROTO_RAW implies IP_HDRINCL).
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    let sa = sockaddr_in(to);
    for i in 0..n {
        let src = [10, 0, 0, 100 + (i % 100) as u8];
        let mut p = [0u8; 40];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&40u16.to_be_bytes());
        p[8] = 64;
        p[9] = libc::IPPROTO_TCP as u8;
        p[12..16].copy_from_slice(&src);
        p[16..20].copy_from_slice(&to.ip().octets());
        let tcp = &mut p[20..];
        tcp[0..2].copy_from_slice(&(20000 + i).to_be_bytes());
        tcp[2..4].copy_from_slice(&to.port().to_be_bytes());
        tcp[4..8].copy_from_slice(&(0x1000_0000u32 + u32::from(i)).to_be_bytes());
        tcp[12] = 5 << 4;
        tcp[13] = 0x02;
        tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
        let mut pseudo = Vec::with_capacity(12);
        pseudo.extend_from_slice(&src);
        pseudo.extend_from_slice(&to.ip().octets());
        pseudo.extend_from_slice(&[0, libc::IPPROTO_TCP as u8, 0, 20]);
        let pre = u32::from(!csum(&pseudo, 0));
        let c = csum(tcp, pre);
        tcp[16..18].copy_from_slice(&c.to_be_bytes());
        // SAFETY: sendto(2) of a 40-byte buffer to a valid sockaddr_in on a descriptor
        // this function owns.
        let sent = unsafe {
            libc::sendto(
                fd,
                p.as_ptr() as *const libc::c_void,
                p.len(),
                0,
                &sa as *const libc::sockaddr_in as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        assert_eq!(sent, 40, "sendto: {}", std::io::Error::last_os_error());
    }
    // SAFETY: closes the descriptor opened above, used by nothing else.
    unsafe { libc::close(fd) };
}

/// 2,000 connections opened at once and dropped without a request (reset, closed, or
/// abandoned mid-handshake), and 200 SYNs from clients that vanished, leave the server
/// serving: a GET right after gets its page at once.
#[test]
fn http_serve_survives_a_flood_of_connections_that_never_ask() {
    let ns = Netns::new("flood");
    let vm = run_in(&ns, "http-serve=8080,n=1", "kernel", &[]);
    let guard = KillOnPanic::new(&vm);
    let to: std::net::SocketAddrV4 = format!("{GUEST}:8080").parse().unwrap();
    let flood = ns.spawn(move || {
        let t0 = Instant::now();
        // The server is up once a connect succeeds (that one is closed with no request).
        while TcpStream::connect_timeout(&to.into(), Duration::from_secs(1)).is_err() {
            assert!(t0.elapsed() < LIMIT, "the guest never listened");
            std::thread::sleep(Duration::from_millis(200));
        }
        let kinds = [Leave::Reset, Leave::Close, Leave::MidHandshake];
        let mut connected = 0;
        for wave in 0..4 {
            let fds: Vec<_> = (0..500).map(|_| start_connect(to)).collect();
            if wave == 1 {
                spoofed_syns(to, 200);
            }
            // Long enough for the accepted ones to finish their handshakes.
            std::thread::sleep(Duration::from_millis(300));
            for (i, fd) in fds.into_iter().enumerate() {
                connected += leave(fd, kinds[i % kinds.len()]) as u32;
            }
        }
        connected
    });
    let connected = flood.join().unwrap();
    let t0 = Instant::now();
    let answers = http_get_all(&ns, &["/after-the-flood"]);
    let waited = t0.elapsed();
    let run = vm.finish(LIMIT);
    guard.defuse();
    let (_, answer) = &answers[0];
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(
        answer.contains("musubi probe: /after-the-flood"),
        "{answer:?}"
    );
    assert!(connected > 0, "the flood reached the server");
    assert!(
        // Before the limits, the slots stayed taken until a 10 s idle timer freed them.
        waited < Duration::from_secs(3),
        "the GET after the flood took {waited:?} ({connected} flood connections were accepted)"
    );
    assert_eq!(run.code, Some(0), "{}", run.explain());
    assert_eq!(run.result("http-serve")["served"], 1);
}
