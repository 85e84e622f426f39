//! What a partition asks for, and what the host has to give: CPU lists, memory.

use crate::Error;
use std::collections::BTreeSet;
use std::fmt;

/// A set of CPU (or NUMA node) numbers in the kernel's list syntax (`0-3,6`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuList(pub BTreeSet<u32>);

/// Upper bound on a CPU number, so `0-4000000000` is refused instead of allocating a set
/// of four billion entries.
const MAX_CPU: u32 = 1 << 16;

impl CpuList {
    /// Parses `flag VALUE`, naming both in the error a person sees.
    pub fn parse(flag: &str, text: &str) -> Result<CpuList, Error> {
        let bad = |why: &str| {
            Error::refused(format!(
                "{flag} {text:?}: {why}; expected a list such as 0, 0-3 or 0,2-3"
            ))
        };
        let mut set = BTreeSet::new();
        if text.trim().is_empty() {
            return Err(bad("empty list"));
        }
        for part in text.trim().split(',') {
            let part = part.trim();
            let (lo, hi) = match part.split_once('-') {
                Some((a, b)) => (a.trim(), b.trim()),
                None => (part, part),
            };
            let num = |s: &str| {
                s.parse::<u32>()
                    .ok()
                    .filter(|n| *n < MAX_CPU)
                    .ok_or_else(|| bad(&format!("{s:?} is not a CPU number")))
            };
            let (lo, hi) = (num(lo)?, num(hi)?);
            if lo > hi {
                return Err(bad(&format!("range {part} runs backwards")));
            }
            set.extend(lo..=hi);
        }
        Ok(CpuList(set))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn intersection(&self, other: &CpuList) -> CpuList {
        CpuList(self.0.intersection(&other.0).copied().collect())
    }

    pub fn is_subset(&self, other: &CpuList) -> bool {
        self.0.is_subset(&other.0)
    }

    pub fn difference(&self, other: &CpuList) -> CpuList {
        CpuList(self.0.difference(&other.0).copied().collect())
    }
}

/// The kernel's compact form, which cgroupfs also accepts.
impl fmt::Display for CpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut iter = self.0.iter().copied().peekable();
        while let Some(lo) = iter.next() {
            let mut hi = lo;
            while iter.peek() == Some(&(hi + 1)) {
                hi = iter.next().unwrap_or(hi);
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if lo == hi {
                write!(f, "{lo}")?;
            } else {
                write!(f, "{lo}-{hi}")?;
            }
        }
        Ok(())
    }
}

impl serde::Serialize for CpuList {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for CpuList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        CpuList::parse("cpus", &s).map_err(serde::de::Error::custom)
    }
}

/// RAM the host keeps for itself, outside every partition: its kernel, page cache for the
/// disk images, the CLI and the supervisors' own small footprint. The larger of 1 GiB and
/// 1/16 of MemTotal.
pub fn host_reserve(mem_total: u64) -> u64 {
    (1u64 << 30).max(mem_total / 16)
}

/// `MemTotal` of the host, in bytes.
pub fn mem_total() -> Result<u64, Error> {
    host_resources::host_memory_bytes()
        .map_err(|e| Error::system(format!("host RAM (sysinfo): {e}")))
}

/// The CPUs the kernel has online.
pub fn online_cpus() -> Result<CpuList, Error> {
    let p = "/sys/devices/system/cpu/online";
    let text = std::fs::read_to_string(p).map_err(|e| Error::system(format!("{p}: {e}")))?;
    CpuList::parse(p, text.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_print_in_kernel_form() {
        let l = CpuList::parse("--cpus", "0-2,5, 7-8").unwrap();
        assert_eq!(l.0.iter().copied().collect::<Vec<_>>(), [0, 1, 2, 5, 7, 8]);
        assert_eq!(l.to_string(), "0-2,5,7-8");
        assert_eq!(CpuList::parse("--cpus", "1").unwrap().to_string(), "1");
        for bad in ["", "a", "3-1", "0-", ",", "1,,2", "-1", "99999999"] {
            let e = CpuList::parse("--cpus", bad).unwrap_err().to_string();
            assert!(e.starts_with("--cpus"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn overlaps_and_subsets() {
        let a = CpuList::parse("c", "0-3").unwrap();
        let b = CpuList::parse("c", "3-5").unwrap();
        assert_eq!(a.intersection(&b).to_string(), "3");
        assert!(CpuList::parse("c", "1-2").unwrap().is_subset(&a));
        assert_eq!(b.difference(&a).to_string(), "4-5");
    }

    #[test]
    fn meminfo_and_reserve() {
        assert_eq!(host_reserve(4 << 30), 1 << 30);
        assert_eq!(host_reserve(32 << 30), 2 << 30);
        assert!(mem_total().unwrap() > 0);
        assert!(!online_cpus().unwrap().is_empty());
    }
}
