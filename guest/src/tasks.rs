//! The task list from `probe.tasks=` and the kernel side of each task.

use core::fmt;

use crate::abi::{STATUS_BLK_FAILED, STATUS_UNKNOWN_TASK, STATUS_USER_FAULT};
use crate::arch::exit_vm;
use crate::bootinfo::{self, BootInfo};
use crate::ulib::JsonBytes;
use crate::user::{self, Outcome, UserEntry};
use crate::{
    apic, console, cpu, kprint, kprintln, mtasks, net, power, smp, timer, utasks, virtio, vsock,
    wtasks,
};

/// Shows command-line bytes (which may be anything) safely inside a JSON string.
pub struct Lossy<'a>(pub &'a [u8]);

impl fmt::Display for Lossy<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        JsonBytes(self.0).fmt(f)
    }
}

/// Options that follow a task in the list (`fib=30,procs=4`) and belong to it.
#[derive(Clone, Copy, Default)]
pub struct Opts {
    /// `procs=P`: P copies of the task spread over the CPUs (`fib`).
    pub procs: Option<u64>,
    /// `iters=N`: iterations (`litmus`) or rounds (`mem-check`).
    pub iters: Option<u64>,
    /// `cpu=K`: run the task's user code on CPU K.
    pub cpu: Option<u64>,
    /// `n=N`: rounds (`udp-echo`), requests (`http-serve`, `udp-counter`) or connections
    /// (`vsock-echo`).
    pub n: Option<u64>,
    /// `bytes=N` (`K`/`M`/`G` suffixes): how much `tcp-send` or `vsock-send` sends.
    pub bytes: Option<u64>,
    /// `ms=N`: the least time `blk-fill` or `pmem-fill` takes, its pieces spread over it
    /// (a fill that lasts long enough to be interrupted, however fast the machine).
    pub ms: Option<u64>,
}

fn option_name(item: &[u8]) -> Option<&'static str> {
    ["procs", "iters", "cpu", "n", "bytes", "ms"]
        .into_iter()
        .find(|o| item.len() > o.len() && item.starts_with(o.as_bytes()) && item[o.len()] == b'=')
}

impl Opts {
    fn set(&mut self, item: &[u8]) -> Result<(), &'static str> {
        let name = option_name(item).ok_or("not an option")?;
        let v = core::str::from_utf8(&item[name.len() + 1..]).ok();
        if name == "bytes" {
            let v = v.and_then(virtio::parse_num);
            self.bytes = Some(v.ok_or("bytes= needs a number (K, M, G suffixes allowed)")?);
            return Ok(());
        }
        let v = v.and_then(|v| v.parse::<u64>().ok());
        let slot = match name {
            "procs" => &mut self.procs,
            "iters" => &mut self.iters,
            "n" => &mut self.n,
            "ms" => &mut self.ms,
            _ => &mut self.cpu,
        };
        *slot = Some(v.ok_or("procs=, iters=, cpu=, n= and ms= need a decimal number")?);
        Ok(())
    }
}

/// What `blk-fill` and `pmem-fill` take.
const FILL_USAGE: &str =
    "blk-fill=SEED and pmem-fill=SEED need a decimal seed up to 4294967295, and ms=N up to 4294967295";

/// Runs the tasks in order. The VM's status is the first non-zero task status. Items
/// `procs=P`, `iters=N`, `cpu=K`, `n=N`, `bytes=N` and `ms=N` are options of the task before
/// them.
pub fn run_all(info: &BootInfo) -> u8 {
    let list = info.param(b"probe.tasks").unwrap_or(b"hello");
    let mut status = 0;
    let mut items = list
        .split(|&b| b == b',')
        .filter(|t| !t.is_empty())
        .peekable();
    while let Some(task) = items.next() {
        let mut opts = Opts::default();
        let mut bad = None;
        while let Some(o) = items.next_if(|i| option_name(i).is_some()) {
            if let Err(why) = opts.set(o) {
                bad.get_or_insert(why);
            }
        }
        smp::reap();
        let s = if option_name(task).is_some() {
            bad_argument(
                task,
                "procs=, iters=, cpu=, n=, bytes= and ms= must follow the task they belong to",
            )
        } else if let Some(why) = bad {
            bad_argument(task, why)
        } else {
            run_one(info, task, opts)
        };
        if status == 0 {
            status = s;
        }
        // The guest shuts down on a power-button press: the tasks left are not run.
        if power::shutdown_requested() {
            power::report_shutdown();
            break;
        }
    }
    status
}

/// Tasks besides the workload tasks whose user code `cpu=K` may move to another CPU.
const MOVABLE: [&[u8]; 13] = [
    b"hello",
    b"user-hello",
    b"blk-crc",
    b"blk-id",
    b"blk-fill",
    b"spin",
    b"fault",
    b"pmem-crc",
    b"pmem-fill",
    b"udp-echo",
    b"tcp-send",
    b"http-serve",
    b"udp-counter",
];

fn run_one(info: &BootInfo, task: &[u8], opts: Opts) -> u8 {
    let (name, arg) = match task.iter().position(|&b| b == b'=') {
        Some(i) => (&task[..i], Some(&task[i + 1..])),
        None => (task, None),
    };
    let num = |a: Option<&[u8]>| {
        a.and_then(|a| core::str::from_utf8(a).ok())
            .and_then(|s| s.parse::<u64>().ok())
    };
    let workload = core::str::from_utf8(name)
        .ok()
        .and_then(|n| workloads::task::parse(n, None))
        .is_some();
    let cpu = match opts.cpu {
        Some(_) if !(MOVABLE.contains(&name) || workload) || opts.procs.is_some() => {
            return bad_argument(task, "cpu=K applies to hello, user-hello, blk-*, spin, fault, pmem-*, the network tasks (without procs=) and the workload tasks (fib without procs=)");
        }
        Some(k) if k as usize >= smp::online() => {
            return bad_argument(task, "cpu=K needs K below the number of CPUs online");
        }
        Some(k) => k as usize,
        None => 0,
    };
    if opts.procs.is_some() && !matches!(name, b"fib" | b"tcp-send" | b"udp-echo") {
        return bad_argument(task, "procs=P applies to fib, tcp-send and udp-echo only");
    }
    if opts.iters.is_some() && name != b"litmus" && name != b"mem-check" {
        return bad_argument(task, "iters=N applies to litmus and mem-check only");
    }
    if opts.n.is_some()
        && !matches!(
            name,
            b"udp-echo" | b"http-serve" | b"udp-counter" | b"vsock-echo"
        )
    {
        return bad_argument(
            task,
            "n=N applies to udp-echo, http-serve, udp-counter and vsock-echo only",
        );
    }
    if opts.bytes.is_some() && name != b"tcp-send" && name != b"vsock-send" {
        return bad_argument(task, "bytes=N applies to tcp-send and vsock-send only");
    }
    if opts.ms.is_some() && name != b"blk-fill" && name != b"pmem-fill" {
        return bad_argument(task, "ms=N applies to blk-fill and pmem-fill only");
    }
    if let (b"fib", Some(p)) = (name, opts.procs) {
        return match num(arg) {
            Some(n) if n <= 100 && (1..=mtasks::MAX_PROCS).contains(&p) => {
                run_user("fib", 0, mtasks::fib_procs, n | p << 32)
            }
            _ => bad_argument(task, "fib=N,procs=P needs N <= 100 and P in 1..=256"),
        };
    }
    if let (Ok(n), Ok(a)) = (
        core::str::from_utf8(name),
        arg.map(core::str::from_utf8).transpose(),
    ) {
        match workloads::task::parse(n, a) {
            Some(Ok(t)) => {
                return finish(
                    t.name(),
                    cpu,
                    user::run_task(cpu, wtasks::workload, &t, timeout()),
                )
            }
            Some(Err(usage)) => return bad_argument(task, usage),
            None => {}
        }
    }
    match (name, arg) {
        (b"pmem-crc", None) => run_user("pmem-crc", cpu, utasks::pmem_crc, 0),
        (b"pmem-fill", a) => match utasks::fill_param(num(a), opts.ms) {
            Some(p) => run_user("pmem-fill", cpu, utasks::pmem_fill, p),
            None => bad_argument(task, FILL_USAGE),
        },
        (b"hello", None) if cpu == 0 => hello(0) as u8,
        (b"hello", None) => {
            if smp::post_kernel(cpu, hello, 0).is_err() {
                return finish("hello", cpu, Outcome::NoCpu);
            }
            match smp::wait(cpu, crate::arch::rdtsc() + 10 * timer::tsc_hz()) {
                Some(s) => s as u8,
                None => finish("hello", cpu, Outcome::TimedOut),
            }
        }
        (b"shared-counter", a) => match num(a) {
            Some(n) if n > 0 => run_user("shared-counter", 0, mtasks::shared_counter, n),
            _ => bad_argument(task, "shared-counter=N needs a positive count"),
        },
        (b"litmus", a) => {
            let test = match a {
                Some(b"mp") => 0,
                Some(b"iriw") => 1,
                Some(b"2+2w") => 2,
                _ => return bad_argument(task, "litmus=mp|iriw|2+2w[,iters=N]"),
            };
            match opts.iters.unwrap_or(mtasks::DEFAULT_ITERS) {
                n @ 1..=0xffff_ffff => run_user("litmus", 0, mtasks::litmus, test | n << 8),
                _ => bad_argument(task, "litmus iters=N needs N in 1..=4294967295"),
            }
        }
        (b"mem-check", a) => mem_check(task, num(a), opts.iters),
        (b"udp-echo" | b"tcp-send" | b"http-serve" | b"udp-counter", a) => {
            net_task(task, name, a, opts, cpu)
        }
        (b"vsock-echo" | b"vsock-send", a) => vsock_task(task, name, a, opts),
        (b"timer", None) => timer_task(),
        (b"console-echo", a) => match a.map_or(Some(console::DEFAULT_WAIT_S), |a| num(Some(a))) {
            Some(secs) if secs > 0 => console::echo_task(secs),
            _ => bad_argument(task, "console-echo=SECS needs a positive number of seconds"),
        },
        (b"wait-power", Some(a)) => match num(Some(a)) {
            Some(secs) if secs > 0 => power::wait_task(secs),
            _ => bad_argument(task, "wait-power=SECS needs a positive number of seconds"),
        },
        (b"user-hello", None) => run_user("user-hello", cpu, utasks::user_hello, 0),
        (b"blk-crc", None) => run_user("blk-crc", cpu, utasks::blk_crc, 0),
        (b"blk-id", None) => run_user("blk-id", cpu, utasks::blk_id, 0),
        (b"blk-fill", a) => match utasks::fill_param(num(a), opts.ms) {
            Some(p) => run_user("blk-fill", cpu, utasks::blk_fill, p),
            None => bad_argument(task, FILL_USAGE),
        },
        (b"fault", None) => run_user("fault", cpu, utasks::fault, 0),
        (b"rng", a) => match a
            .and_then(|a| core::str::from_utf8(a).ok())
            .and_then(virtio::parse_num)
        {
            Some(n @ 1..=RNG_MAX_BYTES) => run_user("rng", 0, utasks::rng, n),
            _ => bad_argument(
                task,
                "rng=BYTES needs 1 to 1G bytes (K, M, G suffixes allowed)",
            ),
        },
        (b"spin", a) => match num(a) {
            Some(n) => run_user("spin", cpu, utasks::spin, n),
            None => bad_argument(task, "spin=N needs a decimal iteration count"),
        },
        (b"exit", a) => match num(a) {
            Some(n) if n <= 255 => exit_vm(n as u8),
            _ => bad_argument(task, "exit=N needs N in 0..=255"),
        },
        (b"hostile-virtio", None) => hostile(info),
        (b"triple-fault", None) => {
            kprintln!("{{\"probe\":\"triple-fault\",\"raising\":true}}");
            cpu::triple_fault()
        }
        _ => {
            kprintln!(
                "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"unknown task\"}}",
                Lossy(name)
            );
            STATUS_UNKNOWN_TASK
        }
    }
}

/// The most bytes one `rng` task reads.
const RNG_MAX_BYTES: u64 = 1 << 30;

/// Rounds of `mem-check` without `iters=`.
const MEM_CHECK_ROUNDS: u64 = 8;

/// `mem-check=MIB[,iters=R]`: MIB must fit the user task's buffer (reported as `max_mib`).
fn mem_check(task: &[u8], mib: Option<u64>, rounds: Option<u64>) -> u8 {
    let max_mib = user::data_bytes() >> 20;
    let rounds = rounds.unwrap_or(MEM_CHECK_ROUNDS);
    match mib {
        Some(m) if (1..=max_mib).contains(&m) && (1..=0xffff_ffff).contains(&rounds) => run_user(
            "mem-check",
            0,
            utasks::mem_check,
            utasks::mem_check_param(m, rounds),
        ),
        _ => {
            kprintln!(
                "{{\"probe\":\"mem-check\",\"ok\":false,\"error\":\"{}\",\"task\":\"{}\",\"max_mib\":{}}}",
                "mem-check=MIB[,iters=R] needs MIB in 1..=max_mib (the user task buffer) and R in 1..=4294967295",
                Lossy(task),
                max_mib
            );
            STATUS_UNKNOWN_TASK
        }
    }
}

/// `udp-echo` rounds and `udp-counter` answers without `n=`; `tcp-send` bytes without
/// `bytes=`.
const NET_DEFAULT_N: u64 = 100;
const NET_DEFAULT_BYTES: u64 = 1 << 20;
/// The most `tcp-send` or `udp-echo` copies (`procs=P`): one per queue pair the guest lays
/// out.
const NET_MAX_PROCS: u64 = crate::abi::NET_MAX_PAIRS as u64;
const NET_PROCS_USAGE: &str =
    "procs=P after tcp-send or udp-echo needs P in 1..=16 and no more than the CPUs online";

/// `procs=P` of `tcp-send` or `udp-echo` (1 without it), if P is one they can run.
fn net_procs(opts: Opts) -> Option<u32> {
    let procs = opts.procs.unwrap_or(1);
    (procs >= 1 && procs as usize <= smp::online() && procs <= NET_MAX_PROCS)
        .then_some(procs as u32)
}
/// The most `udp-echo` rounds (their round-trip times are kept in the task buffer).
const NET_MAX_ROUNDS: u64 = 1_000_000;

fn ipv4(v: &[u8]) -> Option<[u8; 4]> {
    let v: core::net::Ipv4Addr = core::str::from_utf8(v).ok()?.parse().ok()?;
    Some(v.octets())
}

/// `ADDR/PREFIX`.
fn cidr(v: &[u8]) -> Option<([u8; 4], u8)> {
    let slash = v.iter().position(|&b| b == b'/')?;
    let prefix = core::str::from_utf8(&v[slash + 1..])
        .ok()?
        .parse::<u8>()
        .ok()?;
    (prefix <= 32).then_some((ipv4(&v[..slash])?, prefix))
}

/// `HOST:PORT` (an IPv4 address).
fn host_port(v: &[u8]) -> Option<([u8; 4], u16)> {
    let v: core::net::SocketAddrV4 = core::str::from_utf8(v).ok()?.parse().ok()?;
    (v.port() != 0).then_some((v.ip().octets(), v.port()))
}

/// `udp-echo=HOST:PORT[,n=N][,procs=P]`, `tcp-send=HOST:PORT[,bytes=N][,procs=P]`,
/// `http-serve=PORT[,n=N]`, `udp-counter=PORT[,n=N]`, each also with `cpu=K` (not with
/// `procs=`): parses the task and the interface's address (`probe.ip=`, `probe.gw=`), then
/// runs the task at CPL3 (`net::*`) on CPU `cpu`.
fn net_task(task: &[u8], name: &[u8], arg: Option<&[u8]>, opts: Opts, cpu: usize) -> u8 {
    let info = bootinfo::get();
    let Some(ip) = info.param(b"probe.ip") else {
        return bad_argument(
            task,
            "network tasks need probe.ip=ADDR/PREFIX on the command line",
        );
    };
    let Some((ip, prefix)) = cidr(ip) else {
        return bad_argument(
            task,
            "probe.ip=ADDR/PREFIX needs an IPv4 address and a prefix length 0..=32",
        );
    };
    let gw = match info.param(b"probe.gw").map(ipv4) {
        None => None,
        Some(Some(gw)) => Some(gw),
        Some(None) => return bad_argument(task, "probe.gw=ADDR needs an IPv4 address"),
    };
    let mut p = net::Params {
        ip,
        prefix,
        has_gw: gw.is_some(),
        gw: gw.unwrap_or_default(),
        ..net::Params::default()
    };
    let (label, entry): (&str, UserEntry) = match name {
        b"udp-echo" => {
            let (Some((peer, port)), n @ 1..=NET_MAX_ROUNDS) =
                (arg.and_then(host_port), opts.n.unwrap_or(NET_DEFAULT_N))
            else {
                return bad_argument(
                    task,
                    "udp-echo=HOST:PORT[,n=N] needs an IPv4 address, a port and N in 1..=1000000",
                );
            };
            let Some(procs) = net_procs(opts) else {
                return bad_argument(task, NET_PROCS_USAGE);
            };
            (p.peer, p.port, p.count, p.procs) = (peer, port, n, procs);
            ("udp-echo", net::udp_echo)
        }
        b"tcp-send" => {
            let (Some((peer, port)), n @ 1..) = (
                arg.and_then(host_port),
                opts.bytes.unwrap_or(NET_DEFAULT_BYTES),
            ) else {
                return bad_argument(
                    task,
                    "tcp-send=HOST:PORT[,bytes=N] needs an IPv4 address, a port and N > 0",
                );
            };
            let Some(procs) = net_procs(opts) else {
                return bad_argument(task, NET_PROCS_USAGE);
            };
            (p.peer, p.port, p.count, p.procs) = (peer, port, n, procs);
            ("tcp-send", net::tcp_send)
        }
        b"udp-counter" => {
            let port = arg
                .and_then(|a| core::str::from_utf8(a).ok())
                .and_then(|a| a.parse::<u16>().ok());
            let (Some(port @ 1..), n @ 1..) = (port, opts.n.unwrap_or(NET_DEFAULT_N)) else {
                return bad_argument(
                    task,
                    "udp-counter=PORT[,n=N] needs a port in 1..=65535 and N > 0",
                );
            };
            (p.port, p.count) = (port, n);
            ("udp-counter", net::udp_counter)
        }
        _ => {
            let port = arg
                .and_then(|a| core::str::from_utf8(a).ok())
                .and_then(|a| a.parse::<u16>().ok());
            let (Some(port @ 1..), n @ 1..) = (port, opts.n.unwrap_or(1)) else {
                return bad_argument(
                    task,
                    "http-serve=PORT[,n=N] needs a port in 1..=65535 and N > 0",
                );
            };
            (p.port, p.count) = (port, n);
            ("http-serve", net::http_serve)
        }
    };
    finish(label, cpu, user::run_task(cpu, entry, &p, timeout()))
}

/// `vsock-echo=PORT[,n=N]`, `vsock-send=PORT[,bytes=N]`: runs the task at CPL3
/// (`vsock::*`).
fn vsock_task(task: &[u8], name: &[u8], arg: Option<&[u8]>, opts: Opts) -> u8 {
    let port = arg
        .and_then(|a| core::str::from_utf8(a).ok())
        .and_then(|a| a.parse::<u32>().ok());
    let (label, entry, count): (&str, UserEntry, _) = if name == b"vsock-echo" {
        ("vsock-echo", vsock::vsock_echo, opts.n.unwrap_or(1))
    } else {
        let bytes = opts.bytes.unwrap_or(NET_DEFAULT_BYTES);
        ("vsock-send", vsock::vsock_send, bytes)
    };
    let (Some(port), 1..) = (port, count) else {
        return bad_argument(
            task,
            if name == b"vsock-echo" {
                "vsock-echo=PORT[,n=N] needs a port and N > 0"
            } else {
                "vsock-send=PORT[,bytes=N] needs a port and N > 0"
            },
        );
    };
    let p = vsock::Params { port, count };
    finish(label, 0, user::run_task(0, entry, &p, timeout()))
}

fn bad_argument(task: &[u8], why: &str) -> u8 {
    let name = task.split(|&b| b == b'=').next().unwrap_or(task);
    kprintln!(
        "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"{}\",\"task\":\"{}\"}}",
        Lossy(name),
        why,
        Lossy(task)
    );
    STATUS_UNKNOWN_TASK
}

/// Seconds a user task may run (`probe.task_timeout=`, 0 = unlimited).
const DEFAULT_TASK_TIMEOUT_S: u64 = 600;

fn timeout() -> u64 {
    bootinfo::get()
        .param(b"probe.task_timeout")
        .and_then(|v| core::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_TASK_TIMEOUT_S)
}

fn run_user(name: &str, cpu: usize, entry: UserEntry, param: u64) -> u8 {
    finish(name, cpu, user::run(cpu, entry, param, timeout()))
}

/// The `hello` line, printed by the CPU that runs this (`cpu=K` runs it on CPU K as a
/// kernel job): CPUs online, RAM, nodes and the node each CPU found itself on.
fn hello(_: u64) -> u64 {
    let info = bootinfo::get();
    let n = smp::online();
    kprint!(
        "{{\"probe\":\"hello\",\"cpus\":{},\"memory_bytes\":{},\"nodes\":{},\"pv_ipi\":{},\"cpu\":{},\"apic_id\":{},\"cpu_nodes\":[",
        n,
        info.ram_bytes(),
        apic::nodes(),
        apic::pv_ipi_port().is_some(),
        smp::current(),
        apic::id()
    );
    for c in 0..n {
        match smp::node_of(c) {
            Some(node) => kprint!("{}{}", if c > 0 { "," } else { "" }, node),
            None => kprint!("{}null", if c > 0 { "," } else { "" }),
        }
    }
    kprintln!("]}}");
    0
}

/// The task's status from how it ended; reports time-outs and faults.
/// `cpu`: where the task's user code ran.
fn finish(name: &str, cpu: usize, outcome: Outcome) -> u8 {
    let timeout = timeout();
    match outcome {
        Outcome::Exit(code) => code,
        Outcome::TimedOut => {
            kprint!(
                "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"task still running after {} s\",\"unfinished_cpus\":[",
                name,
                timeout
            );
            let mut first = true;
            for c in (1..smp::online()).filter(|&c| c == cpu || smp::unfinished(c)) {
                kprint!("{}{}", if first { "" } else { "," }, c);
                first = false;
            }
            kprintln!("]}}");
            STATUS_USER_FAULT
        }
        Outcome::NoCpu => {
            kprintln!(
                "{{\"probe\":\"{}\",\"ok\":false,\"error\":\"the CPU asked for is not online or still busy\"}}",
                name
            );
            STATUS_USER_FAULT
        }
        Outcome::Fault(f) => {
            let expected = name == "fault" && f.vector == 14 && f.cr2 == utasks::FAULT_ADDR;
            kprint!("{{\"probe\":\"{}\",\"ok\":{},", name, expected);
            if !expected {
                kprint!("\"error\":\"user-mode exception\",");
            }
            kprintln!(
                "\"vector\":{},\"exception\":\"{}\",\"error_code\":{},\"rip\":\"{:#x}\",\"cr2\":\"{:#x}\",\"cpl\":3}}",
                f.vector,
                cpu::exception_name(f.vector),
                f.error,
                f.rip,
                f.cr2
            );
            if expected {
                0
            } else {
                STATUS_USER_FAULT
            }
        }
    }
}

fn timer_task() -> u8 {
    let t0 = timer::ticks();
    let c0 = crate::arch::rdtsc();
    timer::wait_for(200, || false);
    let cycles = crate::arch::rdtsc() - c0;
    kprintln!(
        "{{\"probe\":\"timer\",\"tsc_hz\":{},\"tsc_source\":\"{}\",\"lapic_timer_hz\":{},\"tick_hz\":{},\"timer_ok\":{},\"ticks\":{},\"cycles\":{},\"ns\":{}}}",
        timer::tsc_hz(),
        timer::source(),
        timer::lapic_hz(),
        timer::TICK_HZ,
        timer::timer_ok(),
        timer::ticks() - t0,
        cycles,
        timer::cycles_to_ns(cycles)
    );
    0
}

fn hostile(info: &BootInfo) -> u8 {
    let (spare, _) = user::arena();
    let h = match virtio::hostile(0, info.ram_end(), spare) {
        Ok(h) => h,
        Err(e) => {
            kprintln!(
                "{{\"probe\":\"hostile-virtio\",\"ok\":false,\"error\":\"{}\"}}",
                if virtio::count() == 0 {
                    "no virtio-blk disk"
                } else {
                    e.name()
                }
            );
            return STATUS_BLK_FAILED;
        }
    };
    let completed = h.results[..h.cases]
        .iter()
        .filter(|r| r.completed > 0)
        .count();
    kprint!(
        "{{\"probe\":\"hostile-virtio\",\"cases\":{},\"completed\":{},\"good_read\":{},",
        h.cases,
        completed,
        h.good_read
    );
    if !h.error.is_empty() {
        kprint!("\"error\":\"{}\",", h.error);
    }
    kprint!("\"results\":[");
    for (i, r) in h.results[..h.cases].iter().enumerate() {
        kprint!(
            "{}{{\"case\":\"{}\",\"used_entries\":{},\"status\":{}}}",
            if i > 0 { "," } else { "" },
            r.name,
            r.completed,
            r.status
        );
    }
    kprintln!("]}}");
    if h.good_read {
        0
    } else {
        STATUS_BLK_FAILED
    }
}

pub fn read_only_note() {
    for i in 0..virtio::count() {
        if virtio::read_only(i) {
            kprintln!("probe: disk {} is read-only (writes will fail)", i);
        }
    }
}
