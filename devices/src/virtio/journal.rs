//! The writes a virtio-blk device made to its image since the last checkpoint, kept for a
//! replicator that ships them with the checkpoint's epoch.
//!
//! Bounded: the bytes of the writes are kept up to [`WriteJournal::start`]'s bound; past it
//! the journal keeps only where the writes went, and the replicator reads those ranges
//! straight from the disk file while the VM is still paused at the checkpoint (their
//! contents then are what the guest last wrote there, which is all the standby needs). The
//! device never stops taking requests for the journal's sake; a guest that writes faster
//! than the bound makes its checkpoints' pauses longer instead, as pages past the RAM copy
//! limit do.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Bytes of writes a journal keeps by default before it keeps only their ranges.
pub const DEFAULT_JOURNAL_BOUND: usize = 32 << 20;

/// The writes of one epoch, as sealed at its checkpoint.
#[derive(Debug, PartialEq, Eq)]
pub enum SealedWrites {
    /// Each write's offset and bytes, in the order the device made them.
    Bytes(Vec<(u64, Vec<u8>)>),
    /// More was written than the bound: the (offset, length) ranges written, whose contents
    /// are to be read from the file before the VM resumes.
    FromFile(Vec<(u64, u64)>),
}

impl SealedWrites {
    pub fn is_empty(&self) -> bool {
        match self {
            SealedWrites::Bytes(v) => v.is_empty(),
            SealedWrites::FromFile(v) => v.is_empty(),
        }
    }

    /// What was written later, after `self`.
    fn then(self, later: SealedWrites) -> SealedWrites {
        match (self, later) {
            (SealedWrites::Bytes(mut a), SealedWrites::Bytes(b)) => {
                a.extend(b);
                SealedWrites::Bytes(a)
            }
            (a, b) => {
                let mut r = a.ranges();
                r.extend(b.ranges());
                SealedWrites::FromFile(r)
            }
        }
    }

    fn ranges(self) -> Vec<(u64, u64)> {
        match self {
            SealedWrites::Bytes(v) => v.into_iter().map(|(o, b)| (o, b.len() as u64)).collect(),
            SealedWrites::FromFile(v) => v,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    on: bool,
    bound: usize,
    /// Bytes held in `bytes`.
    held: usize,
    bytes: Vec<(u64, Vec<u8>)>,
    /// Set once past the bound: every write since the last seal, bytes dropped.
    ranges: Option<Vec<(u64, u64)>>,
    sealed: Option<SealedWrites>,
}

/// One disk's journal, shared by its device (which records) and the VM's handle (which
/// seals it at a checkpoint and hands it to the replicator). Off until a replicator starts it.
#[derive(Debug)]
pub struct WriteJournal {
    path: PathBuf,
    /// The image opened again without `O_DIRECT`, for reading ranges and the checksum
    /// (the page cache is coherent with the device's direct writes).
    file: File,
    state: Mutex<State>,
}

impl WriteJournal {
    /// A journal, off, for the image at `path`.
    pub fn open(path: &Path) -> io::Result<WriteJournal> {
        Ok(WriteJournal {
            path: path.to_path_buf(),
            file: File::open(path)?,
            state: Mutex::new(State::default()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts recording, from empty, keeping at most `bound` bytes of writes.
    pub fn start(&self, bound: usize) {
        *self.state() = State {
            on: true,
            bound,
            ..State::default()
        };
    }

    /// Stops recording and drops what was kept.
    pub fn stop(&self) {
        *self.state() = State::default();
    }

    /// A write of `len` bytes at `offset` that reached the file; `fill` copies its bytes.
    pub fn record(&self, offset: u64, len: u64, fill: impl FnOnce(&mut [u8]) -> bool) {
        let mut s = self.state();
        if !s.on || len == 0 {
            return;
        }
        if s.ranges.is_none() && s.held + len as usize <= s.bound {
            let mut b = vec![0u8; len as usize];
            if fill(&mut b) {
                s.held += b.len();
                s.bytes.push((offset, b));
                return;
            }
        }
        let mut ranges = s.ranges.take().unwrap_or_else(|| {
            std::mem::take(&mut s.bytes)
                .into_iter()
                .map(|(o, b)| (o, b.len() as u64))
                .collect()
        });
        s.held = 0;
        ranges.push((offset, len));
        s.ranges = Some(ranges);
    }

    /// Closes the writes so far as one epoch's, while nothing writes (the VM paused).
    pub fn seal(&self) {
        let mut s = self.state();
        if !s.on {
            return;
        }
        let now = match s.ranges.take() {
            Some(r) => SealedWrites::FromFile(r),
            None => SealedWrites::Bytes(std::mem::take(&mut s.bytes)),
        };
        s.held = 0;
        s.sealed = Some(match s.sealed.take() {
            Some(before) => before.then(now),
            None => now,
        });
    }

    /// The writes sealed last, taken (empty if none).
    pub fn take_sealed(&self) -> SealedWrites {
        self.state()
            .sealed
            .take()
            .unwrap_or(SealedWrites::Bytes(Vec::new()))
    }

    /// Reads `buf.len()` bytes of the image at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    /// The image's length and CRC-32, read now.
    pub fn checksum(&self) -> io::Result<FileSum> {
        FileSum::of(&self.file)
    }
}

/// A disk image's length and the CRC-32 of its bytes: what a standby's copy is checked
/// against before replication starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileSum {
    pub len: u64,
    pub crc32: u32,
}

impl FileSum {
    /// Reads all of `file` (a block device too) from its start.
    pub fn of(file: &File) -> io::Result<FileSum> {
        let mut h = crc32fast::Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut len = 0u64;
        loop {
            let n = match file.read_at(&mut buf, len) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            h.update(&buf[..n]);
            len += n as u64;
        }
        Ok(FileSum {
            len,
            crc32: h.finalize(),
        })
    }
}

impl std::fmt::Display for FileSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes, CRC-32 {:#010x}", self.len, self.crc32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn journal() -> (tempfile::NamedTempFile, WriteJournal) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        let j = WriteJournal::open(f.path()).unwrap();
        (f, j)
    }

    fn put(j: &WriteJournal, offset: u64, byte: u8, len: usize) {
        j.record(offset, len as u64, |b| {
            b.fill(byte);
            true
        });
    }

    #[test]
    fn nothing_is_kept_while_off_and_writes_keep_their_order_when_on() {
        let (_f, j) = journal();
        put(&j, 0, 1, 512);
        j.seal();
        assert!(j.take_sealed().is_empty());
        j.start(4096);
        put(&j, 512, 2, 512);
        put(&j, 0, 3, 1024);
        j.seal();
        put(&j, 0, 4, 512);
        assert_eq!(
            j.take_sealed(),
            SealedWrites::Bytes(vec![(512, vec![2; 512]), (0, vec![3; 1024])])
        );
        // The write after the seal is the next epoch's.
        j.seal();
        assert_eq!(
            j.take_sealed(),
            SealedWrites::Bytes(vec![(0, vec![4; 512])])
        );
        j.stop();
        put(&j, 0, 5, 512);
        j.seal();
        assert!(j.take_sealed().is_empty());
    }

    #[test]
    fn past_the_bound_only_ranges_are_kept_and_two_seals_add_up() {
        let (_f, j) = journal();
        j.start(1024);
        put(&j, 0, 1, 512);
        put(&j, 512, 1, 512);
        put(&j, 4096, 1, 512);
        put(&j, 0, 2, 512);
        j.seal();
        put(&j, 1024, 3, 512);
        j.seal();
        assert_eq!(
            j.take_sealed(),
            SealedWrites::FromFile(vec![
                (0, 512),
                (512, 512),
                (4096, 512),
                (0, 512),
                (1024, 512)
            ])
        );
        // The bound applies afresh after a seal.
        put(&j, 0, 4, 512);
        j.seal();
        assert_eq!(
            j.take_sealed(),
            SealedWrites::Bytes(vec![(0, vec![4; 512])])
        );
    }

    #[test]
    fn the_checksum_covers_the_whole_file_and_ranges_read_back() {
        let (_f, j) = journal();
        let s = j.checksum().unwrap();
        assert_eq!(s.len, 8192);
        assert_eq!(s.crc32, crc32fast::hash(&[7u8; 8192]));
        let mut b = [0u8; 16];
        j.read_at(100, &mut b).unwrap();
        assert_eq!(b, [7u8; 16]);
        assert!(s.to_string().contains("8192 bytes"));
    }
}
