//! The benchmark workloads (issues: VMMS §5.2, Mint §5.4, composite hypervisor, paper 004's
//! Table 1) as CPL3 task bodies. The computations and the result lines come from the shared
//! `workloads` crate, which the native program `musubi-native` runs too.

use core::hint::black_box;

use workloads::task::{self, Counters, Measured, Op, Path, Storage, StorageIo, Task};
use workloads::{compile, cycles_to_ns, make, XorShift64};

use crate::abi::{self, Error, STATUS_BLK_FAILED, STATUS_UNKNOWN_TASK};
use crate::arch::outb;
use crate::ulib::{self, Line};

const MAX_REPS: usize = 100;
const COM1: u16 = 0x3f8;
/// Unclaimed by Musubi: every write is a bare port exit.
const PING_PORT: u16 = 0x80;

struct Failure(&'static str, u8);

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure(e.name(), STATUS_BLK_FAILED)
    }
}

fn too_big() -> Failure {
    Failure("buffers do not fit in the task arena", STATUS_UNKNOWN_TASK)
}

/// `len` bytes at `addr`. Callers pass a range in this task's data area (`buf`, `len`), or in
/// a mapping the kernel made for it (file window), and never two live ranges that overlap.
fn bytes_at<'a>(addr: u64, len: u64) -> &'a mut [u8] {
    // SAFETY: per the callers' promise above: mapped user-writable, used by this task alone,
    // and not aliased by another live slice.
    unsafe { core::slice::from_raw_parts_mut(addr as *mut u8, len as usize) }
}

/// Entry of every workload task: `param` is the address of its `Task` (see `user::run_task`).
pub extern "C" fn workload(buf: u64, len: u64, param: u64) -> ! {
    // SAFETY: `user::run_task` wrote a `Task` at `param`, aligned, just for this entry.
    let t = unsafe { core::ptr::read(param as *const Task) };
    if let Task::Make { files, passes } = t {
        build(files, passes, buf, len);
    }
    let hz = ulib::tsc_hz();
    let mut cycles = [0u64; MAX_REPS];
    let mut ns = [0u64; MAX_REPS];
    let mut l = Line::new();
    let status = match run(&t, buf, len, &mut cycles) {
        Ok((n, result, counters)) => {
            for (c, t) in cycles[..n].iter().zip(ns.iter_mut()) {
                *t = cycles_to_ns(*c, hz);
            }
            let m = Measured {
                cycles: &cycles[..n],
                ns: &ns[..n],
                result,
                counters,
            };
            task::report(&mut l, &t, &m);
            0
        }
        Err(Failure(why, status)) => {
            task::report_error(&mut l, t.name(), why);
            status
        }
    };
    l.send();
    ulib::exit(status)
}

/// Runs the task; returns the repetitions measured, the result and the counters.
fn run(
    t: &Task,
    buf: u64,
    len: u64,
    cycles: &mut [u64],
) -> Result<(usize, u64, Counters), Failure> {
    let mut result = 0;
    let mut counters = Counters::default();
    let mut time = |f: &mut dyn FnMut() -> Result<u64, Failure>| -> Result<u64, Failure> {
        let t0 = ulib::rdtsc();
        let r = f()?;
        let c = ulib::rdtsc() - t0;
        result = r;
        Ok(c)
    };
    let reps = match *t {
        Task::MintCpu { m, reps } => {
            for c in &mut cycles[..reps as usize] {
                *c = time(&mut || Ok(workloads::cpu_loop(black_box(m))))?;
            }
            reps as usize
        }
        Task::MintMem { kb, count, reps } => {
            let bytes = kb * 1024;
            if bytes * 2 > len {
                return Err(too_big());
            }
            let (src, dst) = (bytes_at(buf, bytes), bytes_at(buf + bytes, bytes));
            workloads::fill(src, 0, 0);
            for c in &mut cycles[..reps as usize] {
                *c = time(&mut || Ok(workloads::memcpy_loop(dst, src, count)))?;
            }
            reps as usize
        }
        Task::MintIo { kb, count, reps } => {
            let bytes = kb * 1024;
            if bytes > len {
                return Err(too_big());
            }
            let disk_bytes =
                ulib::disk_capacity(0).map_err(|_| Failure("no disk", STATUS_BLK_FAILED))? * 512;
            if disk_bytes < bytes {
                return Err(Failure("disk smaller than one read", STATUS_UNKNOWN_TASK));
            }
            let fd = ulib::open(abi::STORAGE_BLK, 0, disk_bytes, abi::OPEN_DIRECT)?;
            for (r, c) in cycles[..reps as usize].iter_mut().enumerate() {
                let mut rng = XorShift64::new(workloads::rng::mint_io_seed(r as u32));
                *c = time(&mut || {
                    for _ in 0..count {
                        let off = rng.offset(disk_bytes, bytes, task::MINT_IO_ALIGN);
                        ulib::lseek(fd, off)?;
                        ulib::read(fd, buf, bytes)?;
                    }
                    Ok(0)
                })?;
            }
            reps as usize
        }
        Task::BlkSmallReads { count } => {
            let sectors =
                ulib::disk_capacity(0).map_err(|_| Failure("no disk", STATUS_BLK_FAILED))?;
            if sectors == 0 {
                return Err(Failure("empty disk", STATUS_BLK_FAILED));
            }
            let s0 = ulib::stats();
            cycles[0] = time(&mut || {
                for i in 0..count {
                    ulib::blk_read(0, i % sectors, buf, 512)?;
                }
                Ok(0)
            })?;
            counters = s0.delta(&ulib::stats());
            1
        }
        Task::SerialOut { count } => {
            cycles[0] = time(&mut || {
                for k in 0..count {
                    // Lines of 64 letters and a newline; the last byte ends the line.
                    let b = if k % 65 == 64 || k + 1 == count {
                        b'\n'
                    } else {
                        b'a' + ((k / 65) % 26) as u8
                    };
                    outb(COM1, b);
                }
                Ok(0)
            })?;
            1
        }
        Task::PortPing { count } => {
            cycles[0] = time(&mut || {
                for _ in 0..count {
                    outb(PING_PORT, 0);
                }
                Ok(0)
            })?;
            1
        }
        Task::PageTouch { count } => {
            let va = if count > 0 {
                ulib::anon_map(count).map_err(|_| {
                    Failure(
                        "not enough kernel memory for the pages",
                        STATUS_UNKNOWN_TASK,
                    )
                })?
            } else {
                0
            };
            let s0 = ulib::stats();
            cycles[0] = time(&mut || {
                for i in 0..count {
                    // SAFETY: page `i < count` of the anonymous window the kernel just made;
                    // the write faults in a zeroed page.
                    unsafe { core::ptr::write_volatile((va + i * 4096) as *mut u8, 1) };
                }
                Ok(0)
            })?;
            counters = s0.delta(&ulib::stats());
            1
        }
        Task::Fib { n } => {
            cycles[0] = time(&mut || Ok(workloads::fib(black_box(n))))?;
            1
        }
        Task::Getpid { n } => {
            cycles[0] = time(&mut || {
                let mut pid = 0;
                for _ in 0..n {
                    pid = ulib::getpid();
                }
                Ok(pid)
            })?;
            1
        }
        Task::LsLike { n } => {
            let out = bytes_at(buf, 64 * 1024);
            cycles[0] = time(&mut || Ok(workloads::ls::ls_like(black_box(n), out)))?;
            1
        }
        Task::CompileLike { n } => {
            let text = bytes_at(buf, compile::TEXT_BYTES as u64);
            // SAFETY: the arena after `text`, disjoint from it; the arena holds both (the
            // workload's sizes are far below the smallest arena).
            let syms = unsafe {
                core::slice::from_raw_parts_mut(
                    (buf + compile::TEXT_BYTES as u64) as *mut u64,
                    compile::SYMS,
                )
            };
            cycles[0] =
                time(&mut || Ok(workloads::compile::compile_like(black_box(n), text, syms)))?;
            1
        }
        Task::StorageIo(s) => {
            let (c, k) = storage_io(&s, buf, len)?;
            cycles[0] = c;
            counters = k;
            1
        }
        Task::Make { .. } => {
            return Err(Failure("make runs from its own entry", STATUS_UNKNOWN_TASK))
        }
    };
    Ok((reps, result, counters))
}

/// A region whose writes are dropped by the VMM (they do not fault): a changed word does not
/// read back. The word is restored.
fn read_only_region(i: usize) -> bool {
    let Ok(base) = ulib::pmem_info(i, abi::PMEM_BASE) else {
        return false;
    };
    let p = base as *mut u64;
    // SAFETY: the first word of memory-storage region `i`, mapped user-accessible and
    // aligned; the old value is put back.
    unsafe {
        let old = core::ptr::read_volatile(p);
        core::ptr::write_volatile(p, !old);
        let back = core::ptr::read_volatile(p);
        core::ptr::write_volatile(p, old);
        back != !old
    }
}

/// One pass over the extent: `chunk`-sized system calls, or copies to/from the mapping;
/// writes end with fsync (msync for the mapping; a flush for memory storage).
fn pass(s: &StorageIo, fd: u64, va: u64, buf: u64) -> Result<(), Failure> {
    if s.path == Path::Syscall {
        ulib::lseek(fd, 0)?;
    }
    let mut off = 0;
    while off < s.bytes {
        let n = s.chunk.min(s.bytes - off);
        match (s.path, s.op) {
            (Path::Syscall, Op::Read) => {
                if ulib::read(fd, buf, n)? != n {
                    return Err(Failure("short read", STATUS_BLK_FAILED));
                }
            }
            (Path::Syscall, Op::Write) => {
                if ulib::write_fd(fd, buf, n)? != n {
                    return Err(Failure("short write", STATUS_BLK_FAILED));
                }
            }
            (Path::Mmap, Op::Read) => {
                workloads::copy_bytes(bytes_at(buf, n), bytes_at(va + off, n))
            }
            (Path::Mmap, Op::Write) => {
                workloads::copy_bytes(bytes_at(va + off, n), bytes_at(buf, n))
            }
        }
        off += n;
    }
    if s.op == Op::Write {
        ulib::fsync(fd)?;
    }
    Ok(())
}

fn storage_io(s: &StorageIo, buf: u64, len: u64) -> Result<(u64, Counters), Failure> {
    if s.chunk > len {
        return Err(too_big());
    }
    let storage = match s.storage {
        Storage::Pmem => abi::STORAGE_PMEM,
        Storage::Blk => abi::STORAGE_BLK,
    };
    let fd = ulib::open(storage, 0, s.bytes, 0).map_err(|e| match e {
        Error::BadFd | Error::NoSuchDisk => Failure(
            "no such storage (memory-storage region 0 or disk 0)",
            STATUS_BLK_FAILED,
        ),
        Error::OutOfRange => Failure("extent larger than the storage", STATUS_UNKNOWN_TASK),
        Error::NoMemory => Failure(
            "extent larger than the guest page pool (give the VM more memory)",
            STATUS_UNKNOWN_TASK,
        ),
        e => Failure::from(e),
    })?;
    let va = match s.path {
        Path::Mmap => ulib::mmap(fd).map_err(|_| {
            Failure(
                "no memory for the mapping's page tables",
                STATUS_UNKNOWN_TASK,
            )
        })?,
        Path::Syscall => 0,
    };
    if s.op == Op::Write {
        workloads::fill(bytes_at(buf, s.chunk), 0, 0);
        if s.storage == Storage::Pmem && read_only_region(0) {
            return Err(Failure("read-only memory storage", STATUS_BLK_FAILED));
        }
    }
    if s.warm {
        pass(s, fd, va, buf)?;
    } else {
        ulib::drop_caches(fd)?;
    }
    let s0 = ulib::stats();
    let t0 = ulib::rdtsc();
    pass(s, fd, va, buf)?;
    let c = ulib::rdtsc() - t0;
    Ok((c, s0.delta(&ulib::stats())))
}

/// `make=FILES:PASSES`: builds the first `files` sources listed in the make directory at the
/// start of disk 0 (see `workloads::make`), as a make would: read the directory, then per
/// file read the source, compile it in user mode and write the object to its slot, and sync
/// at the end. Every file access is a system call on one cached open file of the whole disk
/// (the guest kernel's page cache, filled from virtio-blk with readahead and written back by
/// fsync). Time inside system calls and in the compile is stamped separately.
fn build(files: u64, passes: u64, buf: u64, len: u64) -> ! {
    let hz = ulib::tsc_hz();
    let mut b = make::Build {
        files,
        passes,
        ..make::Build::default()
    };
    let s0 = ulib::stats();
    let r = build_files(&mut b, buf, len);
    let counters = s0.delta(&ulib::stats());
    let mut l = Line::new();
    let status = match r {
        Ok(()) => {
            b.ns = cycles_to_ns(b.cycles, hz);
            b.sys_ns = cycles_to_ns(b.sys_ns, hz);
            b.compile_ns = cycles_to_ns(b.compile_ns, hz);
            make::report(&mut l, &b, &counters);
            0
        }
        Err(Failure(why, status)) => {
            task::report_error(&mut l, "make", why);
            status
        }
    };
    l.send();
    ulib::exit(status)
}

/// The build; `b.sys_ns` and `b.compile_ns` hold TSC cycles until the caller converts them.
fn build_files(b: &mut make::Build, buf: u64, len: u64) -> Result<(), Failure> {
    const DIR: u64 = make::BLOCK;
    const TEXT: u64 = make::MAX_SOURCE as u64;
    const OBJ: u64 = 2 * make::MAX_SOURCE as u64 + make::OBJ_HEADER as u64;
    const SYMS: u64 = compile::SYMS as u64 * 8;
    if DIR + TEXT + OBJ + SYMS > len {
        return Err(too_big());
    }
    let (dir_at, text_at, obj_at) = (buf, buf + DIR, buf + DIR + TEXT);
    let disk_bytes =
        ulib::disk_capacity(0).map_err(|_| Failure("no disk", STATUS_BLK_FAILED))? * 512;
    if disk_bytes < DIR {
        return Err(Failure(
            "disk smaller than the make directory",
            STATUS_BLK_FAILED,
        ));
    }
    // SAFETY: the arena after the directory, text and object buffers, disjoint from them
    // (checked to fit above) and 8-byte aligned (buf is page-aligned, the sizes multiples of 8).
    let syms =
        unsafe { core::slice::from_raw_parts_mut((obj_at + OBJ) as *mut u64, compile::SYMS) };
    let sys = |b: &mut make::Build, f: &mut dyn FnMut() -> Result<u64, Error>| {
        let t0 = ulib::rdtsc();
        let r = f();
        b.sys_ns += ulib::rdtsc() - t0;
        b.syscalls += 1;
        r.map_err(Failure::from)
    };
    let t0 = ulib::rdtsc();
    let fd = sys(b, &mut || ulib::open(abi::STORAGE_BLK, 0, disk_bytes, 0))?;
    sys(b, &mut || ulib::read(fd, dir_at, DIR))?;
    b.bytes_read += DIR;
    let dir = bytes_at(dir_at, DIR);
    let listed = make::read_dir(dir).map_err(|why| Failure(why, STATUS_UNKNOWN_TASK))?;
    if b.files > listed as u64 {
        return Err(Failure(
            "more files asked for than the disk lists",
            STATUS_UNKNOWN_TASK,
        ));
    }
    for i in 0..b.files as usize {
        let e = make::entry(dir, i);
        if e.src_len > TEXT || e.src_off + e.src_len > disk_bytes {
            return Err(Failure(
                "a source is too large or off the disk",
                STATUS_UNKNOWN_TASK,
            ));
        }
        sys(b, &mut || ulib::lseek(fd, e.src_off))?;
        if sys(b, &mut || ulib::read(fd, text_at, e.src_len))? != e.src_len {
            return Err(Failure("short read", STATUS_BLK_FAILED));
        }
        b.bytes_read += e.src_len;
        let c0 = ulib::rdtsc();
        let o = make::compile(
            bytes_at(text_at, e.src_len),
            b.passes,
            syms,
            bytes_at(obj_at, OBJ),
        )
        .ok_or(Failure("object buffer too small", STATUS_UNKNOWN_TASK))?;
        b.compile_ns += ulib::rdtsc() - c0;
        let n = o.len as u64;
        if n > e.obj_room || e.obj_off + n > disk_bytes {
            return Err(Failure(
                "an object does not fit its slot",
                STATUS_UNKNOWN_TASK,
            ));
        }
        sys(b, &mut || ulib::lseek(fd, e.obj_off))?;
        if sys(b, &mut || ulib::write_fd(fd, obj_at, n))? != n {
            return Err(Failure("short write", STATUS_BLK_FAILED));
        }
        b.bytes_written += n;
        b.result = make::fold(b.result, o.code);
    }
    sys(b, &mut || ulib::fsync(fd))?;
    b.cycles = ulib::rdtsc() - t0;
    Ok(())
}
