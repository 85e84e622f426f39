//! The cgroup back-ends: cgroup v1 (one hierarchy per controller: cpuset, memory, blkio)
//! and cgroup v2 (one unified hierarchy with the cpuset, memory and io controllers).
//!
//! Everything is a few files of cgroupfs, read and written directly: the mounts in
//! `/proc/self/mountinfo`, this process's cgroups in `/proc/self/cgroup`, a directory made
//! per cgroup, `cgroup.subtree_control`, `cpuset.cpus`, `cpuset.mems`, the memory limit, an I/O
//! weight and `cgroup.procs`. (`cgroups-rs` did this before; it brings a D-Bus client for
//! systemd's cgroups into every binary that links it, for a partition that needs none, and it
//! knew only some of the I/O weight files: `blkio.weight` (v1, CFQ) and `io.bfq.weight` (v2),
//! while kernels with BFQ under v1 name it `blkio.bfq.weight` and v2 hosts with io.cost use
//! `io.weight`.)
//!
//! Where a partition's cgroup goes: on v1, under the creating process's own cgroup in each
//! hierarchy, so a partition stays inside whatever its creator is confined to (a container,
//! a service's slice) and inside the subtree it may write. On v2 the "no internal
//! processes" rule forbids enabling controllers below a cgroup that holds processes (the
//! creator's own), so partitions go directly under the root of the unified hierarchy.

use crate::resources::CpuList;
use crate::Error;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The v1 controllers a partition uses, by their cgroupfs names.
const V1_CONTROLLERS: [&str; 3] = ["cpuset", "memory", "blkio"];
/// The same for v2 (block I/O is `io` there).
const V2_CONTROLLERS: [&str; 3] = ["cpuset", "memory", "io"];

/// One directory of a partition's cgroup: on v1 one per controller, on v2 a single one.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Place {
    /// `cpuset`, `memory`, `blkio`; `unified` on v2.
    pub controller: String,
    /// Where the hierarchy is mounted.
    pub mount: PathBuf,
    /// The cgroup's path below the mount point.
    pub rel: String,
    /// The path `/proc/PID/cgroup` shows for a member (the mount may be of a subtree).
    pub proc_path: String,
}

impl Place {
    pub fn dir(&self) -> PathBuf {
        self.mount.join(&self.rel)
    }
}

/// A partition's cgroup, as recorded in its state file so later commands (and other CLI
/// processes) find it without redoing the discovery.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct PartitionCgroup {
    /// 1 or 2.
    pub version: u8,
    pub places: Vec<Place>,
}

/// What the cgroup enforces.
#[derive(Clone, Debug)]
pub struct Limits {
    pub cpus: CpuList,
    pub mems: CpuList,
    pub memory: u64,
    pub io_weight: Option<u32>,
}

/// The host's cgroup set-up.
#[derive(Clone, Debug)]
pub enum Host {
    V1 {
        /// (controller, mount point, root of the mounted subtree)
        mounts: Vec<(String, PathBuf, PathBuf)>,
    },
    V2 {
        root: PathBuf,
    },
}

impl Host {
    /// Finds which cgroup version the host runs and where the controllers are.
    pub fn detect() -> Result<Host, Error> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| Error::system(format!("/proc/self/mountinfo: {e}")))?;
        let mounts = cgroup_mounts(&mountinfo);
        if is_unified(&mounts) {
            let root = PathBuf::from(UNIFIED_MOUNTPOINT);
            let p = root.join("cgroup.controllers");
            let have = std::fs::read_to_string(&p)
                .map_err(|e| Error::system(format!("cgroup v2: {}: {e}", p.display())))?;
            let have: Vec<&str> = have.split_whitespace().collect();
            let missing: Vec<&str> = V2_CONTROLLERS
                .iter()
                .copied()
                .filter(|c| !have.contains(c))
                .collect();
            if !missing.is_empty() {
                return Err(Error::system(format!(
                    "cgroup v2: controller(s) {} not available in {} (has: {})",
                    missing.join(", "),
                    p.display(),
                    have.join(" ")
                )));
            }
            return Ok(Host::V2 { root });
        }
        let mut found = Vec::new();
        for name in V1_CONTROLLERS {
            let m = mounts
                .iter()
                .find(|m| !m.unified && m.controllers.iter().any(|c| c == name))
                .ok_or_else(|| {
                    Error::system(format!(
                        "cgroup v1: the {name} controller is not mounted (see \
                         /proc/self/mountinfo); partitions need cpuset, memory and blkio"
                    ))
                })?;
            found.push((name.to_string(), m.mount.clone(), m.root.clone()));
        }
        Ok(Host::V1 { mounts: found })
    }

    pub fn version(&self) -> u8 {
        match self {
            Host::V1 { .. } => 1,
            Host::V2 { .. } => 2,
        }
    }

    /// Where a cgroup named `name` goes (see the module documentation).
    pub fn plan(&self, name: &str) -> Result<PartitionCgroup, Error> {
        match self {
            Host::V2 { root } => Ok(PartitionCgroup {
                version: 2,
                places: vec![Place {
                    controller: "unified".into(),
                    mount: root.clone(),
                    rel: name.to_string(),
                    proc_path: format!("/{name}"),
                }],
            }),
            Host::V1 { mounts } => {
                let own = std::fs::read_to_string("/proc/self/cgroup")
                    .map(|text| own_v1_paths(&text))
                    .map_err(|e| Error::system(format!("/proc/self/cgroup: {e}")))?;
                let mut places = Vec::new();
                for (controller, mount, mount_root) in mounts {
                    let own_path = own.get(controller).cloned().unwrap_or_else(|| "/".into());
                    // /proc shows paths from the hierarchy's root; the mount may show a
                    // subtree of it.
                    let root = mount_root.to_string_lossy();
                    let below_mount = if root == "/" {
                        own_path.as_str()
                    } else {
                        own_path.strip_prefix(root.as_ref()).unwrap_or("/")
                    };
                    let rel = join_rel(below_mount, name);
                    let proc_path = join_rel(&own_path, name);
                    places.push(Place {
                        controller: controller.clone(),
                        mount: mount.clone(),
                        rel,
                        proc_path: format!("/{proc_path}"),
                    });
                }
                Ok(PartitionCgroup { version: 1, places })
            }
        }
    }
}

fn join_rel(parent: &str, name: &str) -> String {
    let parent = parent.trim_matches('/');
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}/{name}")
    }
}

/// Where systemd and most distributions mount the unified hierarchy.
const UNIFIED_MOUNTPOINT: &str = "/sys/fs/cgroup";

/// One cgroupfs mount from `/proc/self/mountinfo`.
#[derive(Debug, PartialEq, Eq)]
struct Mount {
    /// cgroup2.
    unified: bool,
    /// The v1 controllers it carries (`cpuset`, `memory`, ...).
    controllers: Vec<String>,
    mount: PathBuf,
    /// The root of the hierarchy's subtree that is mounted there.
    root: PathBuf,
}

/// The cgroup mounts in a mountinfo text (proc(5): ID PARENT MAJ:MIN ROOT MOUNT OPTIONS
/// [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS).
fn cgroup_mounts(mountinfo: &str) -> Vec<Mount> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let left: Vec<&str> = left.split_whitespace().collect();
            let mut right = right.split_whitespace();
            let (fstype, _source, opts) = (right.next()?, right.next()?, right.next()?);
            let unified = match fstype {
                "cgroup2" => true,
                "cgroup" => false,
                _ => return None,
            };
            Some(Mount {
                unified,
                controllers: opts.split(',').map(str::to_string).collect(),
                mount: PathBuf::from(unescape(left.get(4)?)),
                root: PathBuf::from(unescape(left.get(3)?)),
            })
        })
        .collect()
}

/// mountinfo writes space, tab, newline and backslash in paths as octal escapes (`\040`).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The host runs the unified hierarchy alone: cgroup2 at the usual place and no v1 hierarchy
/// with a controller a partition needs (a hybrid host keeps those on v1).
fn is_unified(mounts: &[Mount]) -> bool {
    let unified = mounts
        .iter()
        .any(|m| m.unified && m.mount == Path::new(UNIFIED_MOUNTPOINT));
    let v1 = mounts.iter().any(|m| {
        !m.unified
            && m.controllers
                .iter()
                .any(|c| V1_CONTROLLERS.contains(&c.as_str()))
    });
    unified && !v1
}

/// This process's cgroup in each v1 hierarchy, by controller, from `/proc/self/cgroup`
/// (`ID:CONTROLLERS:PATH` per line; v2's line has no controllers).
fn own_v1_paths(text: &str) -> HashMap<String, String> {
    let mut paths = HashMap::new();
    for l in text.lines() {
        let mut f = l.splitn(3, ':');
        let (Some(_), Some(ctls), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        for c in ctls.split(',').filter(|c| !c.is_empty()) {
            paths.insert(c.to_string(), path.to_string());
        }
    }
    paths
}

/// Writes `value` to `file` in cgroup directory `dir`, naming both on failure.
fn write_attr(dir: &Path, file: &str, value: &str) -> Result<(), Error> {
    let p = dir.join(file);
    std::fs::write(&p, value).map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem => {
                " (partitions need write access to cgroupfs: run as root)"
            }
            _ => "",
        };
        Error::system(format!("{}: writing {value:?}: {e}{hint}", p.display()))
    })
}

impl PartitionCgroup {
    /// The controllers the parent of a v2 cgroup must hand down: the ones it does not yet.
    fn enable_v2_controllers(parent: &Path) -> Result<(), Error> {
        let p = parent.join("cgroup.subtree_control");
        let on = std::fs::read_to_string(&p)
            .map_err(|e| Error::system(format!("{}: {e}", p.display())))?;
        let on: Vec<&str> = on.split_whitespace().collect();
        let missing: Vec<String> = V2_CONTROLLERS
            .iter()
            .filter(|c| !on.contains(c))
            .map(|c| format!("+{c}"))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        write_attr(parent, "cgroup.subtree_control", &missing.join(" "))
    }

    /// Creates the cgroup and applies the limits. On failure, whatever was created is
    /// removed again.
    pub fn create(&self, limits: &Limits) -> Result<Limited, Error> {
        let r = self.create_inner(limits);
        if r.is_err() {
            let _ = self.remove(Duration::from_secs(2));
        }
        r
    }

    fn create_inner(&self, limits: &Limits) -> Result<Limited, Error> {
        for place in &self.places {
            if place.dir().exists() {
                return Err(Error::refused(format!(
                    "cgroup {} already exists: another partition (perhaps of another state \
                     directory) uses this name; choose another name or cgroup prefix",
                    place.dir().display()
                )));
            }
        }
        let mut io_weight_file = None;
        for place in &self.places {
            let dir = place.dir();
            if self.version == 2 {
                let parent = dir.parent().unwrap_or(&place.mount);
                Self::enable_v2_controllers(parent)?;
            }
            std::fs::create_dir(&dir).map_err(|e| {
                let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
                    " (partitions need write access to cgroupfs: run as root)"
                } else {
                    ""
                };
                Error::system(format!("cannot create cgroup {}: {e}{hint}", dir.display()))
            })?;
            let unified = place.controller == "unified";
            if unified || place.controller == "cpuset" {
                write_attr(&dir, "cpuset.cpus", &limits.cpus.to_string())?;
                write_attr(&dir, "cpuset.mems", &limits.mems.to_string())?;
            }
            if unified || place.controller == "memory" {
                let file = if unified {
                    "memory.max"
                } else {
                    "memory.limit_in_bytes"
                };
                write_attr(&dir, file, &limits.memory.to_string())?;
            }
            if let Some(w) = limits.io_weight {
                if place.controller == "blkio" || place.controller == "unified" {
                    io_weight_file = write_io_weight(&dir, self.version, w)?;
                }
            }
        }
        Ok(Limited { io_weight_file })
    }

    /// Moves process `pid` (all its threads) into the cgroup.
    pub fn add_process(&self, pid: u32) -> Result<(), Error> {
        for place in &self.places {
            write_attr(&place.dir(), "cgroup.procs", &pid.to_string())?;
        }
        Ok(())
    }

    /// Starts `cmd` already inside the cgroup: the child joins it between fork and exec, so
    /// not one instruction of the program runs outside the partition (moving it after
    /// `spawn` would let it start on any CPU and charge memory to the parent's cgroup).
    pub fn spawn_in(&self, cmd: &mut Command) -> Result<Child, Error> {
        let files: Vec<CString> = self
            .places
            .iter()
            .map(|p| {
                let f = p.dir().join("cgroup.procs");
                CString::new(f.as_os_str().as_bytes())
                    .map_err(|_| Error::system(format!("{}: NUL in the path", f.display())))
            })
            .collect::<Result<_, _>>()?;
        // SAFETY: the closure only calls open, write and close (async-signal-safe) on
        // strings made before the fork, and allocates nothing. "0" names the writer itself.
        unsafe {
            cmd.pre_exec(move || {
                for f in &files {
                    let fd = libc::open(f.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                    let err = std::io::Error::last_os_error();
                    libc::close(fd);
                    if n != 1 {
                        return Err(err);
                    }
                }
                Ok(())
            });
        }
        cmd.spawn().map_err(|e| {
            Error::system(format!(
                "cannot start {:?} in cgroup {}: {e}",
                cmd.get_program(),
                self.places[0].dir().display()
            ))
        })
    }

    /// Processes in the cgroup (in any of its directories).
    pub fn processes(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = Vec::new();
        for place in &self.places {
            if let Ok(text) = std::fs::read_to_string(place.dir().join("cgroup.procs")) {
                pids.extend(
                    text.split_whitespace()
                        .filter_map(|s| s.parse::<u32>().ok()),
                );
            }
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Whether `/proc/PID/cgroup` puts `pid` in this cgroup in every hierarchy it uses.
    pub fn contains(&self, pid: u32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/cgroup")) {
            Ok(text) => self.places.iter().all(|p| {
                text.lines().any(|l| {
                    let mut f = l.splitn(3, ':');
                    let (_, ctls, path) = (f.next(), f.next().unwrap_or(""), f.next());
                    let ctl_match = if p.controller == "unified" {
                        ctls.is_empty()
                    } else {
                        ctls.split(',').any(|c| c == p.controller)
                    };
                    ctl_match && path == Some(p.proc_path.as_str())
                })
            }),
            Err(_) => false,
        }
    }

    pub fn exists(&self) -> bool {
        self.places.iter().any(|p| p.dir().is_dir())
    }

    /// Kills every process left in the cgroup and removes its directories, waiting up to
    /// `patience` for the processes to go (a cgroup with members cannot be removed).
    pub fn remove(&self, patience: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + patience;
        loop {
            let pids = self.processes();
            if pids.is_empty() {
                break;
            }
            for pid in &pids {
                // SAFETY: kill(2) has no memory-safety preconditions.
                unsafe { libc::kill(*pid as libc::pid_t, libc::SIGKILL) };
            }
            if Instant::now() > deadline {
                return Err(Error::system(format!(
                    "cgroup {} still holds processes {pids:?} after SIGKILL",
                    self.places[0].dir().display()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for place in &self.places {
            let dir = place.dir();
            loop {
                match std::fs::remove_dir(&dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    // Exiting members leave the cgroup a moment after they are reaped.
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                    {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    Err(e) => {
                        return Err(Error::system(format!(
                            "cannot remove cgroup {}: {e}",
                            dir.display()
                        )))
                    }
                }
            }
        }
        Ok(())
    }
}

/// What was actually enforced.
#[derive(Clone, Debug)]
pub struct Limited {
    /// The file that took the I/O weight; `None` when the host's I/O scheduler offers no
    /// weight file (then the weight is recorded but not enforced).
    pub io_weight_file: Option<String>,
}

fn write_io_weight(dir: &Path, version: u8, weight: u32) -> Result<Option<String>, Error> {
    let candidates: &[(&str, String)] = if version == 2 {
        &[
            ("io.weight", format!("default {weight}")),
            ("io.bfq.weight", format!("{weight}")),
        ]
    } else {
        &[
            ("blkio.weight", format!("{weight}")),
            ("blkio.bfq.weight", format!("{weight}")),
        ]
    };
    for (file, value) in candidates {
        let p = dir.join(file);
        if p.exists() {
            std::fs::write(&p, value)
                .map_err(|e| Error::system(format!("{}: writing {value:?}: {e}", p.display())))?;
            return Ok(Some(file.to_string()));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_join() {
        assert_eq!(join_rel("/", "p"), "p");
        assert_eq!(join_rel("/a/b", "p"), "a/b/p");
        assert_eq!(join_rel("", "p"), "p");
    }

    #[test]
    fn cgroup_mounts_are_read_from_mountinfo() {
        let text = "\
24 18 0:21 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
25 24 0:22 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate
27 24 0:24 /machine /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset
28 24 0:25 / /sys/fs/cgroup/memory rw shared:9 - cgroup cgroup rw,memory
29 24 0:26 / /sys/fs/cgroup/blk\\040io rw - cgroup cgroup rw,blkio
30 18 0:5 / /proc rw - proc proc rw";
        let m = cgroup_mounts(text);
        assert_eq!(m.len(), 4, "{m:?}");
        assert!(m[0].unified);
        assert_eq!(m[1].root, Path::new("/machine"));
        assert_eq!(m[1].mount, Path::new("/sys/fs/cgroup/cpuset"));
        assert!(m[2].controllers.contains(&"memory".to_string()));
        assert_eq!(m[3].mount, Path::new("/sys/fs/cgroup/blk io"));
        // cgroup2 beside v1 controllers is a hybrid host: the partitions use v1.
        assert!(!is_unified(&m));
        let v2 = cgroup_mounts("30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw");
        assert!(is_unified(&v2));
    }

    #[test]
    fn own_cgroups_are_read_per_controller() {
        let paths = own_v1_paths("12:cpuset:/a\n4:memory:/b/c\n3:cpu,cpuacct:/d\n0::/e\n");
        assert_eq!(paths["cpuset"], "/a");
        assert_eq!(paths["memory"], "/b/c");
        assert_eq!(paths["cpuacct"], "/d");
        assert!(!paths.contains_key(""));
    }

    #[test]
    fn plan_names_one_place_per_controller() {
        let host = Host::detect().expect("cgroups on this host");
        let cg = host.plan("musubi-unit-plan").unwrap();
        match host {
            Host::V1 { .. } => {
                let names: Vec<&str> = cg.places.iter().map(|p| p.controller.as_str()).collect();
                assert_eq!(names, V1_CONTROLLERS);
            }
            Host::V2 { .. } => assert_eq!(cg.places.len(), 1),
        }
        for p in &cg.places {
            assert!(p.rel.ends_with("musubi-unit-plan"));
            assert!(p.proc_path.ends_with("/musubi-unit-plan"));
            // This process is in the parent: the proc path is its own plus the name.
            assert!(!cg.contains(std::process::id()));
        }
    }
}
