//! `musubi-native`: the probe guest's benchmark workloads run as a plain Linux program, with
//! the same task strings and the same JSON result lines (the "no hypervisor" baseline).
//!
//! ```text
//! musubi-native [--disk PATH] [--pmem PATH] TASK...
//! musubi-native 'mint-cpu=100000000' 'mint-io=256:100' --disk disk.img
//! ```
//!
//! Host equivalents of the guest's kernel services: read(2)/lseek(2)/write(2) on the `--disk`
//! file (opened O_DIRECT where the filesystem allows, as the guest's direct virtio reads
//! bypass its page cache), getpid(2) as the trivial system call, anonymous mmap(2) for
//! demand-zero pages, write(2) of one byte to stdout for serial output. Counters only a guest
//! kernel can count print `null`; `page_faults` comes from getrusage(2) (minor + major).

extern crate std;

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write as _};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::process::ExitCode;
use std::time::Instant;
use std::{env, eprintln, format, print, vec, vec::Vec};

use workloads::json::LineBuf;
use workloads::task::{self, Counters, Measured, Op, Path, Storage, StorageIo, Task};
use workloads::{compile, XorShift64};

const O_DIRECT: i32 = 0o40000;
const PROT_READ: i32 = 1;
const PROT_WRITE: i32 = 2;
const MAP_SHARED: i32 = 1;
const MAP_PRIVATE: i32 = 2;
const MAP_ANONYMOUS: i32 = 0x20;
const POSIX_FADV_DONTNEED: i32 = 4;
const MS_SYNC: i32 = 4;
const SYS_GETPID: i64 = 39;

extern "C" {
    fn mmap(addr: *mut u8, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut u8;
    fn munmap(addr: *mut u8, len: usize) -> i32;
    fn msync(addr: *mut u8, len: usize, flags: i32) -> i32;
    fn posix_fadvise(fd: i32, off: i64, len: i64, advice: i32) -> i32;
    fn getrusage(who: i32, usage: *mut [i64; 18]) -> i32;
    fn write(fd: i32, buf: *const u8, n: usize) -> isize;
}

fn rdtsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: reads the time-stamp counter.
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        use std::sync::OnceLock;
        static START: OnceLock<Instant> = OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// A timed part: TSC cycles and wall-clock nanoseconds.
fn timed<R>(f: impl FnOnce() -> R) -> (u64, u64, R) {
    let (t, c) = (Instant::now(), rdtsc());
    let r = f();
    let (c1, t1) = (rdtsc(), t.elapsed());
    (c1 - c, t1.as_nanos() as u64, r)
}

/// The kernel's raw getpid (no library caching).
fn sys_getpid() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: getpid takes no arguments and touches no memory.
    unsafe {
        let r: i64;
        core::arch::asm!("syscall", inlateout("rax") SYS_GETPID => r, out("rcx") _, out("r11") _, options(nostack));
        r as u64
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        std::process::id() as u64
    }
}

fn faults() -> u64 {
    let mut ru = [0i64; 18];
    // SAFETY: RUSAGE_SELF into a buffer the size of struct rusage on 64-bit Linux.
    unsafe { getrusage(0, &mut ru) };
    // ru_utime, ru_stime (2 words each), maxrss, ixrss, idrss, isrss, minflt, majflt.
    (ru[8] + ru[9]) as u64
}

/// A zeroed buffer of `len` bytes aligned to 4 KiB (O_DIRECT).
struct Aligned {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let v = vec![0u8; len + 4096];
        let off = v.as_ptr().align_offset(4096);
        Aligned { v, off, len }
    }

    fn get(&mut self) -> &mut [u8] {
        &mut self.v[self.off..self.off + self.len]
    }
}

struct Opts {
    disk: Option<String>,
    pmem: Option<String>,
}

fn open_direct(path: &str, write: bool) -> Result<File, String> {
    let mut o = OpenOptions::new();
    o.read(true).write(write);
    o.clone()
        .custom_flags(O_DIRECT)
        .open(path)
        .or_else(|_| o.open(path))
        .map_err(|e| format!("cannot open {path}: {e}"))
}

fn need<'a>(p: &'a Option<String>, flag: &str, task: &str) -> Result<&'a str, String> {
    p.as_deref()
        .ok_or_else(|| format!("{task} needs {flag} PATH (a file to stand for the device)"))
}

struct Out {
    cycles: Vec<u64>,
    ns: Vec<u64>,
    result: u64,
    counters: Counters,
}

impl Out {
    fn one(c: u64, n: u64) -> Out {
        Out {
            cycles: vec![c],
            ns: vec![n],
            result: 0,
            counters: Counters::default(),
        }
    }
}

fn run(t: &Task, o: &Opts) -> Result<Out, String> {
    let mut out = Out {
        cycles: Vec::new(),
        ns: Vec::new(),
        result: 0,
        counters: Counters::default(),
    };
    let mut rep = |c: u64, n: u64| {
        out.cycles.push(c);
        out.ns.push(n);
    };
    match *t {
        Task::MintCpu { m, reps } => {
            for _ in 0..reps {
                let (c, n, _) = timed(|| workloads::cpu_loop(std::hint::black_box(m)));
                rep(c, n);
            }
        }
        Task::MintMem { kb, count, reps } => {
            let bytes = (kb * 1024) as usize;
            let mut src = vec![0u8; bytes];
            let mut dst = vec![0u8; bytes];
            workloads::fill(&mut src, 0, 0);
            for _ in 0..reps {
                let (c, n, _) = timed(|| workloads::memcpy_loop(&mut dst, &src, count));
                rep(c, n);
            }
        }
        Task::MintIo { kb, count, reps } => {
            for (c, n) in mint_io(o, kb, count, reps)? {
                rep(c, n);
            }
        }
        Task::BlkSmallReads { count } => {
            let (c, n) = blk_small_reads(o, count)?;
            out = Out::one(c, n);
        }
        Task::SerialOut { count } => {
            let (c, n) = serial_out(count);
            out = Out::one(c, n);
        }
        Task::PortPing { .. } => {
            return Err("port I/O has no meaning in a host program".into());
        }
        Task::PageTouch { count } => out = page_touch(count),
        Task::Fib { n: arg } => {
            let (c, n, r) = timed(|| workloads::fib(std::hint::black_box(arg)));
            out = Out::one(c, n);
            out.result = r;
        }
        Task::Getpid { n: arg } => {
            let (c, n, r) = timed(|| {
                let mut pid = 0;
                for _ in 0..arg {
                    pid = sys_getpid();
                }
                pid
            });
            out = Out::one(c, n);
            out.result = r;
        }
        Task::LsLike { n: arg } => {
            let mut buf = vec![0u8; 64 * 1024];
            let (c, n, r) = timed(|| workloads::ls::ls_like(std::hint::black_box(arg), &mut buf));
            out = Out::one(c, n);
            out.result = r;
        }
        Task::CompileLike { n: arg } => {
            let mut text = vec![0u8; compile::TEXT_BYTES];
            let mut syms = vec![0u64; compile::SYMS];
            let (c, n, r) =
                timed(|| compile::compile_like(std::hint::black_box(arg), &mut text, &mut syms));
            out = Out::one(c, n);
            out.result = r;
        }
        Task::Make { .. } => {
            return Err(
                "make runs natively in `musubi bench composite`, over one real file per source"
                    .into(),
            )
        }
        Task::StorageIo(s) => {
            let (c, n, f) = storage_io(&s, o)?;
            out = Out::one(c, n);
            out.counters.page_faults = Some(f);
        }
    }
    Ok(out)
}

/// `mint-io`: `reps` times, `count` reads of `kb` KiB at random aligned offsets of
/// `--disk`, bypassing the host page cache; the (cycles, ns) of each repetition.
fn mint_io(o: &Opts, kb: u64, count: u64, reps: u32) -> Result<Vec<(u64, u64)>, String> {
    let path = need(&o.disk, "--disk", "mint-io")?;
    let mut f = open_direct(path, false)?;
    let disk_bytes = f.metadata().map_err(|e| e.to_string())?.len() & !511;
    let bytes = kb * 1024;
    if disk_bytes < bytes {
        return Err(format!("{path} is smaller than one read of {kb} KiB"));
    }
    let mut buf = Aligned::new(bytes as usize);
    let mut times = Vec::new();
    for r in 0..reps {
        let mut rng = XorShift64::new(workloads::rng::mint_io_seed(r));
        let (c, n, res) = timed(|| -> std::io::Result<()> {
            for _ in 0..count {
                let off = rng.offset(disk_bytes, bytes, task::MINT_IO_ALIGN);
                f.seek(SeekFrom::Start(off))?;
                f.read_exact(buf.get())?;
            }
            Ok(())
        });
        res.map_err(|e| format!("reading {path}: {e}"))?;
        times.push((c, n));
    }
    Ok(times)
}

/// `blk-small-reads`: `count` single-sector reads of `--disk` in turn, bypassing the host
/// page cache.
fn blk_small_reads(o: &Opts, count: u64) -> Result<(u64, u64), String> {
    let path = need(&o.disk, "--disk", "blk-small-reads")?;
    let f = open_direct(path, false)?;
    let sectors = f.metadata().map_err(|e| e.to_string())?.len() / 512;
    if sectors == 0 {
        return Err(format!("{path} is empty"));
    }
    // O_DIRECT needs whole logical blocks: read the 4 KiB holding the sector then.
    let mut buf = Aligned::new(4096);
    let (c, n, res) = timed(|| -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        for i in 0..count {
            let off = (i % sectors) * 512;
            let r = f.read_at(&mut buf.get()[..512], off);
            if r.is_err() {
                f.read_at(buf.get(), off & !4095)?;
            }
        }
        Ok(())
    });
    res.map_err(|e| format!("reading {path}: {e}"))?;
    Ok((c, n))
}

/// `serial-out`: `count` bytes to stdout, one write each, in lines of 65.
fn serial_out(count: u64) -> (u64, u64) {
    let (c, n, _) = timed(|| {
        for k in 0..count {
            let b = if k % 65 == 64 || k + 1 == count {
                b'\n'
            } else {
                b'a' + ((k / 65) % 26) as u8
            };
            // SAFETY: one byte from a local.
            unsafe { write(1, &b, 1) };
        }
    });
    (c, n)
}

/// `page-touch`: the first write to each of `count` fresh pages, with the faults it took.
fn page_touch(count: u64) -> Out {
    let len = (count * 4096) as usize;
    let f0 = faults();
    let (c, n, _) = timed(|| {
        if count > 0 {
            // SAFETY: a fresh private anonymous mapping, touched and unmapped here.
            unsafe {
                let p = mmap(
                    core::ptr::null_mut(),
                    len,
                    PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS,
                    -1,
                    0,
                );
                for i in 0..count as usize {
                    core::ptr::write_volatile(p.add(i * 4096), 1);
                }
                munmap(p, len);
            }
        }
    });
    let mut out = Out::one(c, n);
    out.counters.page_faults = Some(faults() - f0);
    out
}

/// The guest's four access paths on a host file: `--disk` for `blk` (through the host page
/// cache), `--pmem` for `pmem` (a shared mapping, e.g. on tmpfs). Cold: the file's pages are
/// dropped from the host page cache (`POSIX_FADV_DONTNEED`, after writing dirty ones back)
/// and the mapping is fresh.
fn storage_io(s: &StorageIo, o: &Opts) -> Result<(u64, u64, u64), String> {
    let (path, flag) = match s.storage {
        Storage::Blk => (&o.disk, "--disk"),
        Storage::Pmem => (&o.pmem, "--pmem"),
    };
    let path = need(path, flag, "storage-io")?;
    let mut f = OpenOptions::new()
        .read(true)
        .write(s.op == Op::Write)
        .open(path)
        .map_err(|e| format!("cannot open {path}: {e}"))?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    if len < s.bytes {
        return Err(format!(
            "{path} ({len} bytes) is smaller than the extent ({} bytes)",
            s.bytes
        ));
    }
    let bytes = s.bytes as usize;
    let chunk = s.chunk as usize;
    let mut buf = vec![0u8; chunk];
    if s.op == Op::Write {
        workloads::fill(&mut buf, 0, 0);
    }
    let fd = f.as_raw_fd();
    let prot = if s.op == Op::Write {
        PROT_READ | PROT_WRITE
    } else {
        PROT_READ
    };
    let map = || -> Result<*mut u8, String> {
        // SAFETY: a shared mapping of the file's first `bytes` bytes, unmapped below.
        let p = unsafe { mmap(core::ptr::null_mut(), bytes, prot, MAP_SHARED, fd, 0) };
        if p as isize == -1 {
            Err(format!("cannot mmap {path}"))
        } else {
            Ok(p)
        }
    };
    let mut pass = |f: &mut File, p: *mut u8| -> Result<(), String> {
        let e = |e: std::io::Error| format!("{path}: {e}");
        if s.path == Path::Syscall {
            f.seek(SeekFrom::Start(0)).map_err(e)?;
        }
        let mut off = 0;
        while off < bytes {
            let n = chunk.min(bytes - off);
            match (s.path, s.op) {
                (Path::Syscall, Op::Read) => f.read_exact(&mut buf[..n]).map_err(e)?,
                (Path::Syscall, Op::Write) => f.write_all(&buf[..n]).map_err(e)?,
                (Path::Mmap, Op::Read) => {
                    // SAFETY: `p` maps `bytes` bytes of the file and `off + n <= bytes`.
                    let mapped = unsafe { core::slice::from_raw_parts(p.add(off), n) };
                    workloads::copy_bytes(&mut buf[..n], mapped)
                }
                (Path::Mmap, Op::Write) => {
                    // SAFETY: as for reads, and no other reference to the mapping is live.
                    let mapped = unsafe { core::slice::from_raw_parts_mut(p.add(off), n) };
                    workloads::copy_bytes(mapped, &buf[..n])
                }
            }
            off += n;
        }
        if s.op == Op::Write {
            match s.path {
                Path::Syscall => f.sync_data().map_err(e)?,
                // SAFETY: the mapping made above.
                Path::Mmap => unsafe {
                    msync(p, bytes, MS_SYNC);
                },
            }
        }
        Ok(())
    };
    let mut p = if s.path == Path::Mmap {
        map()?
    } else {
        core::ptr::null_mut()
    };
    if s.warm {
        pass(&mut f, p)?;
    } else {
        f.sync_all().map_err(|e| e.to_string())?;
        // SAFETY: plain system calls on our own descriptor and mapping.
        unsafe {
            posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            if !p.is_null() {
                munmap(p, bytes);
            }
        }
        if s.path == Path::Mmap {
            p = map()?;
        }
    }
    let f0 = faults();
    let (c, n, r) = timed(|| pass(&mut f, p));
    let faults = faults() - f0;
    r?;
    if !p.is_null() {
        // SAFETY: the mapping made above.
        unsafe { munmap(p, bytes) };
    }
    Ok((c, n, faults))
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: musubi-native [--disk PATH] [--pmem PATH] TASK...\n\
         tasks (as the probe guest's probe.tasks=): mint-cpu=M[:REPS] mint-mem=KB:N[:REPS] \
         mint-io=KB:L[:REPS] blk-small-reads=N serial-out=N page-touch=N fib=N getpid=N \
         ls-like=N compile-like=N storage-io=pmem|blk:read|write:syscall|mmap:warm|cold:BYTES[:CHUNK]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut opts = Opts {
        disk: None,
        pmem: None,
    };
    let mut tasks = Vec::new();
    let mut args = env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--disk" | "--pmem" => {
                let Some(v) = args.next() else { return usage() };
                let v = v
                    .strip_prefix("path=")
                    .or_else(|| v.strip_prefix("file="))
                    .unwrap_or(&v)
                    .to_string();
                if a == "--disk" {
                    opts.disk = Some(v);
                } else {
                    opts.pmem = Some(v);
                }
            }
            "-h" | "--help" => {
                usage();
                return ExitCode::SUCCESS;
            }
            _ => tasks.extend(a.split(',').filter(|t| !t.is_empty()).map(str::to_string)),
        }
    }
    if tasks.is_empty() {
        return usage();
    }
    let mut status = 0u8;
    for t in &tasks {
        let (name, arg) = match t.split_once('=') {
            Some((n, a)) => (n, Some(a)),
            None => (t.as_str(), None),
        };
        let mut line = LineBuf::<4096>::new();
        let s = match task::parse(name, arg) {
            None => {
                task::report_error(&mut line, name, "unknown task");
                2
            }
            Some(Err(why)) => {
                task::report_error(&mut line, name, why);
                2
            }
            Some(Ok(task)) => match run(&task, &opts) {
                Ok(out) => {
                    let m = Measured {
                        cycles: &out.cycles,
                        ns: &out.ns,
                        result: out.result,
                        counters: out.counters,
                    };
                    task::report(&mut line, &task, &m);
                    0
                }
                Err(why) => {
                    task::report_error(&mut line, name, &why.replace('"', "'"));
                    if matches!(task, Task::PortPing { .. }) {
                        2
                    } else {
                        3
                    }
                }
            },
        };
        print!("{}", String::from_utf8_lossy(line.as_bytes()));
        let _ = std::io::stdout().flush();
        if status == 0 {
            status = s;
        }
    }
    ExitCode::from(status)
}
