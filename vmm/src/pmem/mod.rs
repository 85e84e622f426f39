//! Storage as memory: file-backed guest-physical regions (VMMS, paper 000).
//!
//! Each `--pmem` file is mapped `MAP_SHARED` into this process and registered as its own KVM
//! memory slot above guest RAM. Guest loads and stores then hit the host page cache pages of
//! the file directly: no device model runs, and a store is in the file's page cache the
//! moment the guest makes it, so it survives even a SIGKILL of the VMM. `msync` at flush and
//! at exit pushes it on to the disk.
//!
//! Placement and the region list live here and nowhere else: the E820 / PVH memory map
//! entries, the virtio-pmem configuration and the KVM slots are all derived from
//! [`PmemRegions`], so they cannot disagree.
//!
//! Sizes: a region must be a whole number of 2 MiB. Linux maps persistent memory with
//! `struct page`s in 2 MiB subsections (DAX needs them), and a region that ends mid-section is
//! refused by the guest. Padding is not offered: it would mean either growing the user's file
//! behind their back or mapping past its end, where any access is a SIGBUS. A file longer
//! than `size=` is allowed: the guest sees its first `size` bytes and the rest is untouched.
//!
//! - `spec.rs`: what `--pmem` and the JSON config ask for.
//! - `place.rs`: where the regions go in guest-physical space.
//! - `file.rs`: opening one file and deciding how many of its bytes the guest sees.
//! - `regions.rs`: the mapped regions, their KVM slots, E820 entries, devices and `msync`.
//! - `guard.rs`: the device that logs guest stores into read-only regions.

mod file;
mod guard;
mod place;
mod regions;
mod spec;

pub use guard::log_this_write;
pub use place::{check_layout, host_phys_bits, place, Occupant, PlaceError, PMEM_ALIGN};
pub use regions::{check_slots, sync_regions, PmemRegion, PmemRegions, SyncError};
pub use spec::{Advertise, PmemConfig, PMEM_SYNTAX};

use crate::config::ConfigError;
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;

/// Why a `--pmem` region cannot be set up; every message names the flag and the file.
#[derive(Debug, thiserror::Error)]
pub enum PmemError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("--pmem file={}: {why}", file.display())]
    File { file: PathBuf, why: String },
    #[error("--pmem: {0}")]
    Layout(String),
    #[error("--pmem: {0}")]
    Place(#[from] Box<PlaceError>),
}

fn file_err(file: &Path, why: impl Into<String>) -> PmemError {
    PmemError::File {
        file: file.to_path_buf(),
        why: why.into(),
    }
}

fn describe_size(bytes: u64) -> String {
    if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{bytes} bytes ({} MiB)", bytes / MIB)
    } else {
        format!("{bytes} bytes")
    }
}

/// Files and configurations for the tests of every part.
#[cfg(test)]
pub(crate) mod test_files {
    use super::{Advertise, PmemConfig};
    use std::path::Path;

    pub fn file_of(len: u64) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(len).unwrap();
        f
    }

    pub fn cfg(f: &Path) -> PmemConfig {
        PmemConfig {
            file: f.to_path_buf(),
            size: None,
            readonly: false,
            advertise: Advertise::E820,
        }
    }
}
