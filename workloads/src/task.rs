//! Task strings shared by the probe guest (`probe.tasks=...`) and `musubi-native`, and the
//! result lines both print, so their keys are the same by construction.

use core::fmt::Write;

use crate::json::Obj;

pub const DEFAULT_REPS: u32 = 10;
pub const DEFAULT_CHUNK: u64 = 64 * 1024;
/// Alignment of `mint-io`'s random offsets (a page: O_DIRECT natively, sectors in a VM).
pub const MINT_IO_ALIGN: u64 = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    Pmem,
    Blk,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    Syscall,
    Mmap,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorageIo {
    pub storage: Storage,
    pub op: Op,
    pub path: Path,
    pub warm: bool,
    pub bytes: u64,
    pub chunk: u64,
}

impl StorageIo {
    pub fn storage_name(&self) -> &'static str {
        match self.storage {
            Storage::Pmem => "pmem",
            Storage::Blk => "blk",
        }
    }

    pub fn op_name(&self) -> &'static str {
        match self.op {
            Op::Read => "read",
            Op::Write => "write",
        }
    }

    pub fn path_name(&self) -> &'static str {
        match self.path {
            Path::Syscall => "syscall",
            Path::Mmap => "mmap",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    MintCpu {
        m: u64,
        reps: u32,
    },
    MintMem {
        kb: u64,
        count: u64,
        reps: u32,
    },
    MintIo {
        kb: u64,
        count: u64,
        reps: u32,
    },
    BlkSmallReads {
        count: u64,
    },
    SerialOut {
        count: u64,
    },
    PortPing {
        count: u64,
    },
    PageTouch {
        count: u64,
    },
    Fib {
        n: u64,
    },
    Getpid {
        n: u64,
    },
    LsLike {
        n: u64,
    },
    CompileLike {
        n: u64,
    },
    StorageIo(StorageIo),
    /// A make-like build of `files` sources from the disk (see `make`).
    Make {
        files: u64,
        passes: u64,
    },
}

impl Task {
    pub fn name(&self) -> &'static str {
        match self {
            Task::MintCpu { .. } => "mint-cpu",
            Task::MintMem { .. } => "mint-mem",
            Task::MintIo { .. } => "mint-io",
            Task::BlkSmallReads { .. } => "blk-small-reads",
            Task::SerialOut { .. } => "serial-out",
            Task::PortPing { .. } => "port-ping",
            Task::PageTouch { .. } => "page-touch",
            Task::Fib { .. } => "fib",
            Task::Getpid { .. } => "getpid",
            Task::LsLike { .. } => "ls-like",
            Task::CompileLike { .. } => "compile-like",
            Task::StorageIo(_) => "storage-io",
            Task::Make { .. } => "make",
        }
    }
}

/// A decimal number with an optional binary suffix (`K`, `M`, `G`), or `0x` hex.
pub fn parse_num(s: &str) -> Option<u64> {
    let (digits, mult) = match s.as_bytes().last()? {
        b'k' | b'K' => (&s[..s.len() - 1], 1u64 << 10),
        b'm' | b'M' => (&s[..s.len() - 1], 1 << 20),
        b'g' | b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let v = match digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        Some(h) => u64::from_str_radix(h, 16).ok()?,
        None => digits.parse::<u64>().ok()?,
    };
    v.checked_mul(mult)
}

fn fields<const N: usize>(arg: &str, min: usize) -> Option<([u64; N], usize)> {
    let mut out = [0u64; N];
    let mut k = 0;
    for part in arg.split(':') {
        if k == N {
            return None;
        }
        out[k] = parse_num(part)?;
        k += 1;
    }
    (k >= min).then_some((out, k))
}

fn reps(v: &[u64], k: usize, at: usize) -> Option<u32> {
    if k > at {
        u32::try_from(v[at])
            .ok()
            .filter(|&r| (1..=100).contains(&r))
    } else {
        Some(DEFAULT_REPS)
    }
}

fn storage_io(arg: &str) -> Result<StorageIo, &'static str> {
    const USAGE: &str =
        "storage-io=pmem|blk:read|write:syscall|mmap:warm|cold:BYTES[:CHUNK] (BYTES and CHUNK multiples of 4K)";
    let mut p = arg.split(':');
    let mut next = || p.next().ok_or(USAGE);
    let storage = match next()? {
        "pmem" => Storage::Pmem,
        "blk" => Storage::Blk,
        _ => return Err(USAGE),
    };
    let op = match next()? {
        "read" => Op::Read,
        "write" => Op::Write,
        _ => return Err(USAGE),
    };
    let path = match next()? {
        "syscall" => Path::Syscall,
        "mmap" => Path::Mmap,
        _ => return Err(USAGE),
    };
    let warm = match next()? {
        "warm" => true,
        "cold" => false,
        _ => return Err(USAGE),
    };
    let bytes = parse_num(next()?).ok_or(USAGE)?;
    let chunk = match p.next() {
        Some(c) => parse_num(c).ok_or(USAGE)?,
        None => DEFAULT_CHUNK,
    };
    if p.next().is_some()
        || bytes == 0
        || chunk == 0
        || !bytes.is_multiple_of(4096)
        || !chunk.is_multiple_of(4096)
    {
        return Err(USAGE);
    }
    Ok(StorageIo {
        storage,
        op,
        path,
        warm,
        bytes,
        chunk: chunk.min(bytes),
    })
}

/// Parses `name` with its argument (the text after `=`). `None`: not a task of this crate;
/// `Some(Err(usage))`: a bad argument.
pub fn parse(name: &str, arg: Option<&str>) -> Option<Result<Task, &'static str>> {
    let one = |usage: &'static str| arg.and_then(parse_num).ok_or(usage);
    let r = match name {
        "mint-cpu" => {
            const U: &str = "mint-cpu=M[:REPS] (REPS 1..=100)";
            arg.and_then(|a| fields::<2>(a, 1))
                .and_then(|(v, k)| {
                    Some(Task::MintCpu {
                        m: v[0],
                        reps: reps(&v, k, 1)?,
                    })
                })
                .ok_or(U)
        }
        "mint-mem" | "mint-io" => {
            const U: &str = "mint-mem=KB:N[:REPS] / mint-io=KB:L[:REPS] (KB > 0, e.g. 256, 512, 1024; REPS 1..=100)";
            arg.and_then(|a| fields::<3>(a, 2))
                .filter(|(v, _)| v[0] > 0 && v[0] <= 1 << 20)
                .and_then(|(v, k)| {
                    let (kb, count, reps) = (v[0], v[1], reps(&v, k, 2)?);
                    Some(if name == "mint-mem" {
                        Task::MintMem { kb, count, reps }
                    } else {
                        Task::MintIo { kb, count, reps }
                    })
                })
                .ok_or(U)
        }
        "blk-small-reads" => one("blk-small-reads=N").map(|count| Task::BlkSmallReads { count }),
        "serial-out" => one("serial-out=N").map(|count| Task::SerialOut { count }),
        "port-ping" => one("port-ping=N").map(|count| Task::PortPing { count }),
        "page-touch" => one("page-touch=N").map(|count| Task::PageTouch { count }),
        "fib" => one("fib=N (N <= 93 fits in 64 bits)")
            .and_then(|n| {
                if n <= 100 {
                    Ok(n)
                } else {
                    Err("fib=N needs N <= 100")
                }
            })
            .map(|n| Task::Fib { n }),
        "getpid" => one("getpid=N").map(|n| Task::Getpid { n }),
        "ls-like" => one("ls-like=N").map(|n| Task::LsLike { n }),
        "compile-like" => one("compile-like=N").map(|n| Task::CompileLike { n }),
        "make" => {
            const U: &str = "make=FILES[:PASSES] (FILES 1..=255, the sources on disk 0)";
            arg.and_then(|a| fields::<2>(a, 1))
                .filter(|(v, _)| (1..=crate::make::MAX_FILES as u64).contains(&v[0]))
                .map(|(v, k)| Task::Make {
                    files: v[0],
                    passes: if k > 1 {
                        v[1]
                    } else {
                        crate::make::DEFAULT_PASSES
                    },
                })
                .ok_or(U)
        }
        "storage-io" => arg
            .ok_or("storage-io needs an argument")
            .and_then(storage_io)
            .map(Task::StorageIo),
        _ => return None,
    };
    Some(r)
}

/// Counters only a kernel can measure; `None` prints `null` (native runs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub kernel_copy_bytes: Option<u64>,
    pub page_faults: Option<u64>,
    pub virtio_requests: Option<u64>,
    pub interrupts: Option<u64>,
}

/// What a run measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct Measured<'a> {
    /// One entry per repetition for the `mint-*` tasks, else one entry.
    pub cycles: &'a [u64],
    pub ns: &'a [u64],
    /// The workload's result (`fib`, `getpid`, `ls-like`, `compile-like`).
    pub result: u64,
    pub counters: Counters,
}

/// Writes the result line of `task`.
pub fn report<W: Write>(w: &mut W, task: &Task, m: &Measured) {
    let mut o = Obj::new(w, task.name());
    let one = |v: &[u64]| v.first().copied().unwrap_or(0);
    match *task {
        Task::MintCpu { m: iters, reps } => {
            o.u("m", iters).u("reps", reps as u64);
            o.arr("cycles", m.cycles).arr("ns", m.ns);
        }
        Task::MintMem { kb, count, reps } | Task::MintIo { kb, count, reps } => {
            o.u("kb", kb).u("count", count).u("reps", reps as u64);
            o.arr("cycles", m.cycles).arr("ns", m.ns);
        }
        Task::BlkSmallReads { count } => {
            o.u("count", count)
                .u("cycles", one(m.cycles))
                .u("ns", one(m.ns))
                .opt("interrupts", m.counters.interrupts);
        }
        Task::SerialOut { count } | Task::PortPing { count } => {
            o.u("count", count)
                .u("cycles", one(m.cycles))
                .u("ns", one(m.ns));
        }
        Task::PageTouch { count } => {
            o.u("count", count)
                .u("cycles", one(m.cycles))
                .u("ns", one(m.ns))
                .opt("page_faults", m.counters.page_faults);
        }
        Task::Fib { n } | Task::Getpid { n } | Task::LsLike { n } | Task::CompileLike { n } => {
            o.u("n", n)
                .u("cycles", one(m.cycles))
                .u("ns", one(m.ns))
                .u("result", m.result);
        }
        Task::StorageIo(s) => {
            o.s("storage", s.storage_name())
                .s("op", s.op_name())
                .s("path", s.path_name())
                .b("warm", s.warm)
                .u("bytes", s.bytes)
                .u("chunk", s.chunk)
                .u("cycles", one(m.cycles))
                .u("ns", one(m.ns))
                .opt("kernel_copy_bytes", m.counters.kernel_copy_bytes)
                .opt("page_faults", m.counters.page_faults)
                .opt("virtio_requests", m.counters.virtio_requests)
                .opt("interrupts", m.counters.interrupts);
        }
        Task::Make { files, passes } => {
            // The probe guest prints the full line (`make::report`); this is the short form.
            o.u("files", files)
                .u("passes", passes)
                .u("cycles", one(m.cycles))
                .u("ns", one(m.ns))
                .u("result", m.result);
        }
    }
    o.end();
}

/// Writes `{"probe":"<name>","ok":false,"error":"<why>"}`.
pub fn report_error<W: Write>(w: &mut W, name: &str, why: &str) {
    Obj::new(w, name).b("ok", false).s("error", why).end();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::LineBuf;

    fn p(s: &str) -> Option<Result<Task, &'static str>> {
        match s.split_once('=') {
            Some((n, a)) => parse(n, Some(a)),
            None => parse(s, None),
        }
    }

    #[test]
    fn parses_every_task() {
        assert_eq!(
            p("mint-cpu=100"),
            Some(Ok(Task::MintCpu { m: 100, reps: 10 }))
        );
        assert_eq!(
            p("mint-cpu=1M:3"),
            Some(Ok(Task::MintCpu {
                m: 1 << 20,
                reps: 3
            }))
        );
        assert_eq!(
            p("mint-mem=256:100"),
            Some(Ok(Task::MintMem {
                kb: 256,
                count: 100,
                reps: 10
            }))
        );
        assert_eq!(
            p("mint-io=1024:5:2"),
            Some(Ok(Task::MintIo {
                kb: 1024,
                count: 5,
                reps: 2
            }))
        );
        assert_eq!(p("port-ping=7"), Some(Ok(Task::PortPing { count: 7 })));
        assert_eq!(p("fib=30"), Some(Ok(Task::Fib { n: 30 })));
        assert_eq!(
            p("storage-io=blk:write:mmap:cold:8M"),
            Some(Ok(Task::StorageIo(StorageIo {
                storage: Storage::Blk,
                op: Op::Write,
                path: Path::Mmap,
                warm: false,
                bytes: 8 << 20,
                chunk: 64 << 10,
            })))
        );
        assert_eq!(
            p("make=140"),
            Some(Ok(Task::Make {
                files: 140,
                passes: crate::make::DEFAULT_PASSES
            }))
        );
        assert_eq!(
            p("make=3:0"),
            Some(Ok(Task::Make {
                files: 3,
                passes: 0
            }))
        );
        assert_eq!(p("hello"), None);
    }

    #[test]
    fn rejects_bad_arguments() {
        for bad in [
            "mint-cpu",
            "mint-cpu=x",
            "mint-cpu=5:0",
            "mint-cpu=5:1:2",
            "mint-mem=0:5",
            "mint-io=256",
            "fib=101",
            "make",
            "make=0",
            "make=256",
            "make=3:1:2",
            "storage-io=disk:read:syscall:warm:8M",
            "storage-io=pmem:read:syscall:warm:1000",
            "storage-io=pmem:read:syscall:hot:8M",
            "storage-io=pmem:read:syscall:warm:8M:64K:1",
        ] {
            assert!(matches!(p(bad), Some(Err(_))), "{bad}");
        }
    }

    #[test]
    fn report_lines() {
        let mut l = LineBuf::<512>::new();
        report(
            &mut l,
            &Task::Fib { n: 10 },
            &Measured {
                cycles: &[5],
                ns: &[2],
                result: 55,
                ..Default::default()
            },
        );
        assert_eq!(
            core::str::from_utf8(l.as_bytes()).unwrap(),
            "{\"probe\":\"fib\",\"n\":10,\"cycles\":5,\"ns\":2,\"result\":55}\n"
        );
        l.clear();
        let t = p("storage-io=pmem:read:syscall:warm:8M").unwrap().unwrap();
        report(
            &mut l,
            &t,
            &Measured {
                cycles: &[1],
                ns: &[1],
                counters: Counters {
                    kernel_copy_bytes: Some(8),
                    ..Default::default()
                },
                ..Default::default()
            },
        );
        assert_eq!(
            core::str::from_utf8(l.as_bytes()).unwrap(),
            "{\"probe\":\"storage-io\",\"storage\":\"pmem\",\"op\":\"read\",\"path\":\"syscall\",\"warm\":true,\"bytes\":8388608,\"chunk\":65536,\"cycles\":1,\"ns\":1,\"kernel_copy_bytes\":8,\"page_faults\":null,\"virtio_requests\":null,\"interrupts\":null}\n"
        );
    }
}
