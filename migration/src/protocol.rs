//! The messages of a migration, carried as the bytes of `Envelope::Migration` on an
//! authenticated link, and the numbering of guest pages both ends share.
//!
//! Source (S) and destination (D), in order:
//! - S: `Part(Config, ..)`* `End(Config)`; D checks it and builds the VM on RAM whose
//!   every page is absent: `Ready`, or `Refused(why)`.
//! - Pre-copy only, while the VM runs on S: `Page`* (every page that may hold data, then
//!   in rounds those written meanwhile, a page as often as it was written), and after the
//!   pause the pages written last. D installs each, a later copy over an earlier one.
//! - S pauses the VM; S: `Part(State, ..)`* `End(State)`; D puts the state into the VM:
//!   `Built` or `Failed(why)`. Until here the source's VM can go on (S resumes it).
//! - S: `Switch`, the point of no return: D starts the VM. S: `Listed { data_pages }` once
//!   it has listed the pages that may hold data (none after a pre-copy). From the switch on
//!   D sends `Want(page)` for each page a fault needs (once) and S sends `Page` for those
//!   first and for every listed page meanwhile, each once, then `Done`.
//! - D, once `Done` came (every page with data is in; every other page is zeros):
//!   `AllHeld`, and S ends its VM as migrated. D sends `Ended` instead if its VM ended
//!   before, which ends the source's VM as migrated too.
//!
//! Replication to a standby (see [`crate::replication`]) uses the same framing: after the
//! configuration, the standby answers `Standing` (built, waiting) or `Refused`; then each
//! epoch is `Page`* `DiskWrite`* `PmemPage`* `Part(State, ..)`* `End(State)`
//! [`Part(Frames, ..)`* `End(Frames)`] `Commit`, acknowledged by `Acked`; an epoch that
//! carried frames (the output the guest sent during it, held on the primary) is followed
//! by `Released` once the primary has written them. A primary whose VM ended says `Ended`.
//! A VM with disks or memory-storage files has their checksums (`DiskSums`, then
//! `PmemSums`) follow the configuration.
//!
//! Pages are numbered by their offset in guest RAM's ranges laid one after the other
//! ([`RamLayout`]), which is also how the destination maps them.

use dsm::PAGE_SIZE;

/// The two documents sent in parts before the switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blob {
    /// The VM's configuration (JSON).
    Config,
    /// The vCPU, interrupt controller, clock and device state of the paused VM (JSON).
    State,
    /// Replication: the frames the network devices held for an epoch (see
    /// [`encode_frames`]).
    Frames,
}

/// An epoch's held frames: each with its network device's number, in the order sent.
pub type Frames = Vec<(u32, Vec<u8>)>;

/// The `Frames` document: per frame its device (u32) and length (u32), little-endian,
/// then its bytes.
pub fn encode_frames(frames: &[(u32, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(frames.iter().map(|f| 8 + f.1.len()).sum());
    for (net, frame) in frames {
        out.extend_from_slice(&net.to_le_bytes());
        out.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        out.extend_from_slice(frame);
    }
    out
}

/// A `Frames` document that does not split into whole frames.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the frames of an epoch end inside a frame, at byte {at} of {len}")]
pub struct FramesError {
    pub at: usize,
    pub len: usize,
}

/// Reads back what [`encode_frames`] wrote.
pub fn decode_frames(bytes: &[u8]) -> Result<Frames, FramesError> {
    let mut out = Vec::new();
    let mut at = 0;
    let err = |at| FramesError {
        at,
        len: bytes.len(),
    };
    while at < bytes.len() {
        let head = bytes.get(at..at + 8).ok_or(err(at))?;
        let net = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
        let n = u32::from_le_bytes(head[4..].try_into().expect("4 bytes")) as usize;
        let frame = bytes.get(at + 8..at + 8 + n).ok_or(err(at))?;
        out.push((net, frame.to_vec()));
        at += 8 + n;
    }
    Ok(out)
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    Part(Blob, Vec<u8>),
    End(Blob),
    Ready,
    Refused(String),
    Built,
    Failed(String),
    Switch,
    /// How many pages may hold data and will come (asked or pushed): sent once the
    /// source has listed them, which it does while the VM already runs on the destination.
    Listed {
        data_pages: u64,
    },
    Want(u64),
    Page {
        page: u64,
        data: Box<[u8; PAGE_SIZE]>,
    },
    Done {
        pushed: u64,
    },
    AllHeld,
    Ended,
    /// Replication: the standby built the VM and waits for epochs; the primary must prove
    /// it lives at least once per `heartbeat_ms` milliseconds.
    Standing {
        heartbeat_ms: u64,
    },
    /// Replication: closes epoch `epoch`, which carried `pages` pages and the state before.
    Commit {
        epoch: u64,
        pages: u64,
    },
    /// Replication: every part of epoch `.0` is stored on the standby.
    Acked(u64),
    /// Replication: the frames epoch `.0` carried have been written out by the primary; a
    /// standby taking over from that epoch does not send them again.
    Released(u64),
    /// Replication, right after the configuration of a VM with disks: each disk's length
    /// and CRC-32 when the primary started recording its writes, in `--disk` order; the
    /// standby's copies must match them.
    DiskSums(Vec<(u64, u32)>),
    /// Replication: `data` was written at `offset` of disk `disk` during the epoch under
    /// way; the standby writes it on its copy at the epoch's `Commit`, in the order sent.
    DiskWrite {
        disk: u32,
        offset: u64,
        data: Vec<u8>,
    },
    /// Replication, after the disks' checksums, for a VM with memory-storage files: each
    /// file's length and CRC-32 when the primary started tracking its regions' pages, in
    /// `--pmem` order; the standby's copies must match them.
    PmemSums(Vec<(u64, u32)>),
    /// Replication: the page at `offset` of memory-storage region `region`, as the guest
    /// left it in the epoch under way; the standby writes it on its copy at the `Commit`.
    PmemPage {
        region: u32,
        offset: u64,
        data: Box<[u8; PAGE_SIZE]>,
    },
}

/// Most bytes of a document one `Part` carries.
pub const PART_BYTES: usize = 12 * 1024;
/// Most bytes of a disk write one `DiskWrite` carries; longer writes go in several.
pub const DISK_WRITE_BYTES: usize = 12 * 1024;
/// Most disks (or memory-storage files) one `DiskSums` (`PmemSums`) lists.
const MAX_DISK_SUMS: usize = 1024;
/// Longest reason a `Refused` or `Failed` carries; longer ones are cut.
const MAX_REASON: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed migration message (tag {tag:#04x}, {len} bytes): {why}")]
pub struct MsgError {
    pub tag: u8,
    pub len: usize,
    pub why: &'static str,
}

const T_PART: u8 = 1;
const T_END: u8 = 2;
const T_READY: u8 = 3;
const T_REFUSED: u8 = 4;
const T_BUILT: u8 = 5;
const T_FAILED: u8 = 6;
const T_SWITCH: u8 = 7;
const T_WANT: u8 = 8;
const T_PAGE: u8 = 9;
const T_DONE: u8 = 10;
const T_ALL_HELD: u8 = 11;
const T_ENDED: u8 = 12;
const T_LISTED: u8 = 13;
const T_STANDING: u8 = 14;
const T_COMMIT: u8 = 15;
const T_ACKED: u8 = 16;
const T_DISK_SUMS: u8 = 17;
const T_DISK_WRITE: u8 = 18;
const T_RELEASED: u8 = 19;
const T_PMEM_SUMS: u8 = 20;
const T_PMEM_PAGE: u8 = 21;

fn blob_byte(b: Blob) -> u8 {
    match b {
        Blob::Config => 0,
        Blob::State => 1,
        Blob::Frames => 2,
    }
}

fn cut(s: &str) -> &[u8] {
    let mut n = s.len().min(MAX_REASON);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    &s.as_bytes()[..n]
}

impl Msg {
    /// Short name for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Part(..) => "part",
            Msg::End(_) => "end",
            Msg::Ready => "ready",
            Msg::Refused(_) => "refused",
            Msg::Built => "built",
            Msg::Failed(_) => "failed",
            Msg::Switch => "switch",
            Msg::Listed { .. } => "listed",
            Msg::Want(_) => "want",
            Msg::Page { .. } => "page",
            Msg::Done { .. } => "done",
            Msg::AllHeld => "all-held",
            Msg::Ended => "ended",
            Msg::Standing { .. } => "standing",
            Msg::Commit { .. } => "commit",
            Msg::Acked(_) => "acked",
            Msg::Released(_) => "released",
            Msg::DiskSums(_) => "disk-sums",
            Msg::DiskWrite { .. } => "disk-write",
            Msg::PmemSums(_) => "pmem-sums",
            Msg::PmemPage { .. } => "pmem-page",
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Msg::Part(b, bytes) => {
                out.push(T_PART);
                out.push(blob_byte(*b));
                out.extend_from_slice(&bytes[..bytes.len().min(PART_BYTES)]);
            }
            Msg::End(b) => {
                out.push(T_END);
                out.push(blob_byte(*b));
            }
            Msg::Ready => out.push(T_READY),
            Msg::Refused(why) => {
                out.push(T_REFUSED);
                out.extend_from_slice(cut(why));
            }
            Msg::Built => out.push(T_BUILT),
            Msg::Failed(why) => {
                out.push(T_FAILED);
                out.extend_from_slice(cut(why));
            }
            Msg::Switch => out.push(T_SWITCH),
            Msg::Listed { data_pages } => {
                out.push(T_LISTED);
                out.extend_from_slice(&data_pages.to_le_bytes());
            }
            Msg::Want(page) => {
                out.push(T_WANT);
                out.extend_from_slice(&page.to_le_bytes());
            }
            Msg::Page { page, data } => {
                out.push(T_PAGE);
                out.extend_from_slice(&page.to_le_bytes());
                out.extend_from_slice(&data[..]);
            }
            Msg::Done { pushed } => {
                out.push(T_DONE);
                out.extend_from_slice(&pushed.to_le_bytes());
            }
            Msg::AllHeld => out.push(T_ALL_HELD),
            Msg::Ended => out.push(T_ENDED),
            Msg::Standing { heartbeat_ms } => {
                out.push(T_STANDING);
                out.extend_from_slice(&heartbeat_ms.to_le_bytes());
            }
            Msg::Commit { epoch, pages } => {
                out.push(T_COMMIT);
                out.extend_from_slice(&epoch.to_le_bytes());
                out.extend_from_slice(&pages.to_le_bytes());
            }
            Msg::Acked(epoch) => {
                out.push(T_ACKED);
                out.extend_from_slice(&epoch.to_le_bytes());
            }
            Msg::Released(epoch) => {
                out.push(T_RELEASED);
                out.extend_from_slice(&epoch.to_le_bytes());
            }
            Msg::DiskSums(sums) => {
                out.push(T_DISK_SUMS);
                encode_sums(&mut out, sums);
            }
            Msg::PmemSums(sums) => {
                out.push(T_PMEM_SUMS);
                encode_sums(&mut out, sums);
            }
            Msg::PmemPage {
                region,
                offset,
                data,
            } => {
                out.push(T_PMEM_PAGE);
                out.extend_from_slice(&region.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&data[..]);
            }
            Msg::DiskWrite { disk, offset, data } => {
                out.push(T_DISK_WRITE);
                out.extend_from_slice(&disk.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&data[..data.len().min(DISK_WRITE_BYTES)]);
            }
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Msg, MsgError> {
        let Some((&tag, rest)) = bytes.split_first() else {
            return Err(MsgError {
                tag: 0,
                len: 0,
                why: "empty",
            });
        };
        let err = |why| MsgError {
            tag,
            len: bytes.len(),
            why,
        };
        let exact = |n: usize| {
            if rest.len() == n {
                Ok(rest)
            } else {
                Err(err("wrong length"))
            }
        };
        let u64_of = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let blob = |b: u8| match b {
            0 => Ok(Blob::Config),
            1 => Ok(Blob::State),
            2 => Ok(Blob::Frames),
            _ => Err(err("unknown document")),
        };
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        Ok(match tag {
            T_PART => {
                let (&b, data) = rest.split_first().ok_or(err("no document byte"))?;
                if data.len() > PART_BYTES {
                    return Err(err("part longer than PART_BYTES"));
                }
                Msg::Part(blob(b)?, data.to_vec())
            }
            T_END => Msg::End(blob(exact(1)?[0])?),
            T_READY => exact(0).map(|_| Msg::Ready)?,
            T_REFUSED => Msg::Refused(text(rest)),
            T_BUILT => exact(0).map(|_| Msg::Built)?,
            T_FAILED => Msg::Failed(text(rest)),
            T_SWITCH => exact(0).map(|_| Msg::Switch)?,
            T_LISTED => Msg::Listed {
                data_pages: u64_of(exact(8)?),
            },
            T_WANT => Msg::Want(u64_of(exact(8)?)),
            T_PAGE => {
                let b = exact(8 + PAGE_SIZE)?;
                let mut data = Box::new([0u8; PAGE_SIZE]);
                data.copy_from_slice(&b[8..]);
                Msg::Page {
                    page: u64_of(b),
                    data,
                }
            }
            T_DONE => Msg::Done {
                pushed: u64_of(exact(8)?),
            },
            T_ALL_HELD => exact(0).map(|_| Msg::AllHeld)?,
            T_ENDED => exact(0).map(|_| Msg::Ended)?,
            T_STANDING => Msg::Standing {
                heartbeat_ms: u64_of(exact(8)?),
            },
            T_COMMIT => {
                let b = exact(16)?;
                Msg::Commit {
                    epoch: u64_of(b),
                    pages: u64_of(&b[8..]),
                }
            }
            T_ACKED => Msg::Acked(u64_of(exact(8)?)),
            T_RELEASED => Msg::Released(u64_of(exact(8)?)),
            T_DISK_SUMS => Msg::DiskSums(decode_sums(rest).ok_or(err(SUMS_NOT_WHOLE))?),
            T_PMEM_SUMS => Msg::PmemSums(decode_sums(rest).ok_or(err(SUMS_NOT_WHOLE))?),
            T_PMEM_PAGE => {
                let b = exact(12 + PAGE_SIZE)?;
                let mut data = Box::new([0u8; PAGE_SIZE]);
                data.copy_from_slice(&b[12..]);
                Msg::PmemPage {
                    region: u32::from_le_bytes(b[..4].try_into().expect("4 bytes")),
                    offset: u64_of(&b[4..]),
                    data,
                }
            }
            T_DISK_WRITE => {
                if rest.len() < 12 {
                    return Err(err("disk write without its disk and offset"));
                }
                let data = &rest[12..];
                if data.is_empty() || data.len() > DISK_WRITE_BYTES {
                    return Err(err("disk write empty or longer than DISK_WRITE_BYTES"));
                }
                Msg::DiskWrite {
                    disk: u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")),
                    offset: u64_of(&rest[4..]),
                    data: data.to_vec(),
                }
            }
            _ => return Err(err("unknown tag")),
        })
    }
}

const SUMS_NOT_WHOLE: &str = "file sums not whole (length, CRC) pairs";

/// A `DiskSums` or `PmemSums` list: (length, CRC-32) pairs, at most [`MAX_DISK_SUMS`].
fn encode_sums(out: &mut Vec<u8>, sums: &[(u64, u32)]) {
    for (len, crc) in sums.iter().take(MAX_DISK_SUMS) {
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&crc.to_le_bytes());
    }
}

fn decode_sums(rest: &[u8]) -> Option<Vec<(u64, u32)>> {
    if !rest.len().is_multiple_of(12) || rest.len() / 12 > MAX_DISK_SUMS {
        return None;
    }
    Some(
        rest.chunks_exact(12)
            .map(|c| {
                let len = u64::from_le_bytes(c[..8].try_into().expect("8 bytes"));
                let crc = u32::from_le_bytes(c[8..].try_into().expect("4 bytes"));
                (len, crc)
            })
            .collect(),
    )
}

/// RAM ranges that cannot be numbered as pages.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RamLayoutError {
    #[error("RAM range {gpa:#x}+{len:#x} is not whole pages")]
    NotPages { gpa: u64, len: u64 },
    #[error("RAM range {gpa:#x}+{len:#x} wraps")]
    Wraps { gpa: u64, len: u64 },
    #[error("RAM ranges overlap")]
    Overlap,
}

/// Guest RAM's ranges (guest-physical start, length), laid one after the other: how pages
/// are numbered on the wire and placed in the destination's mapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamLayout {
    ranges: Vec<(u64, u64)>,
}

impl RamLayout {
    /// Refuses ranges that are not page-aligned or that overlap.
    pub fn new(ranges: Vec<(u64, u64)>) -> Result<RamLayout, RamLayoutError> {
        let page = PAGE_SIZE as u64;
        for &(gpa, len) in &ranges {
            if !gpa.is_multiple_of(page) || !len.is_multiple_of(page) || len == 0 {
                return Err(RamLayoutError::NotPages { gpa, len });
            }
            gpa.checked_add(len)
                .ok_or(RamLayoutError::Wraps { gpa, len })?;
        }
        let mut sorted = ranges.clone();
        sorted.sort();
        if sorted.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(RamLayoutError::Overlap);
        }
        Ok(RamLayout { ranges })
    }

    /// Bytes of RAM in all.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.1).sum()
    }

    pub fn pages(&self) -> u64 {
        self.bytes() / PAGE_SIZE as u64
    }

    /// The wire number of the page holding `gpa`.
    pub fn page_of(&self, gpa: u64) -> Option<u64> {
        let mut at = 0;
        for &(start, len) in &self.ranges {
            if gpa >= start && gpa < start + len {
                return Some((at + gpa - start) / PAGE_SIZE as u64);
            }
            at += len;
        }
        None
    }

    /// The guest-physical address of wire page `page`.
    pub fn gpa_of(&self, page: u64) -> Option<u64> {
        let mut off = page.checked_mul(PAGE_SIZE as u64)?;
        for &(start, len) in &self.ranges {
            if off < len {
                return Some(start + off);
            }
            off -= len;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Msg> {
        let mut data = Box::new([0u8; PAGE_SIZE]);
        data[7] = 9;
        vec![
            Msg::Part(Blob::Config, b"{}".to_vec()),
            Msg::Part(Blob::State, vec![1; PART_BYTES]),
            Msg::End(Blob::State),
            Msg::Ready,
            Msg::Refused("no disk".into()),
            Msg::Built,
            Msg::Failed("KVM said no".into()),
            Msg::Switch,
            Msg::Listed { data_pages: 77 },
            Msg::Want(u64::MAX),
            Msg::Page { page: 3, data },
            Msg::Done { pushed: 5 },
            Msg::AllHeld,
            Msg::Ended,
            Msg::Standing { heartbeat_ms: 100 },
            Msg::Commit { epoch: 9, pages: 1 },
            Msg::Acked(u64::MAX - 1),
            Msg::Released(4),
            Msg::Part(Blob::Frames, vec![2; 100]),
            Msg::End(Blob::Frames),
            Msg::DiskSums(vec![(1 << 30, 0xdead_beef), (512, 0)]),
            Msg::DiskWrite {
                disk: 1,
                offset: 4096,
                data: vec![5; DISK_WRITE_BYTES],
            },
            Msg::PmemSums(vec![(16 << 20, 0x8bff_b675)]),
            Msg::PmemPage {
                region: 2,
                offset: 1 << 21,
                data: Box::new([6; PAGE_SIZE]),
            },
        ]
    }

    #[test]
    fn every_message_round_trips_and_fits_an_envelope() {
        for m in all() {
            let b = m.encode();
            assert!(b.len() <= dsm_host::MAX_MIGRATION_BYTES, "{}", m.name());
            assert_eq!(Msg::decode(&b).unwrap(), m);
        }
    }

    #[test]
    fn wrong_lengths_and_tags_are_refused() {
        for m in all() {
            let b = m.encode();
            let fixed = !matches!(
                m,
                Msg::Part(..) | Msg::Refused(_) | Msg::Failed(_) | Msg::DiskWrite { .. }
            );
            if fixed {
                assert!(Msg::decode(&b[..b.len() - 1]).is_err(), "{} cut", m.name());
                let mut long = b.clone();
                long.push(0);
                assert!(Msg::decode(&long).is_err(), "{} long", m.name());
            }
        }
        assert!(Msg::decode(&[]).is_err());
        assert!(Msg::decode(&[99]).is_err());
        assert!(Msg::decode(&[T_END, 7]).is_err());
        assert!(Msg::decode(&[T_PART]).is_err());
    }

    #[test]
    fn long_reasons_are_cut_on_a_character_boundary() {
        let why = "é".repeat(MAX_REASON);
        match Msg::decode(&Msg::Refused(why).encode()).unwrap() {
            Msg::Refused(s) => assert!(s.len() <= MAX_REASON && s.chars().all(|c| c == 'é')),
            m => panic!("{m:?}"),
        }
    }

    #[test]
    fn frames_round_trip_and_a_cut_document_is_refused() {
        let frames = vec![(0, vec![1; 60]), (1, vec![2; 70_000]), (0, vec![3; 13])];
        let doc = encode_frames(&frames);
        assert_eq!(decode_frames(&doc).unwrap(), frames);
        assert_eq!(decode_frames(&[]).unwrap(), Vec::new());
        for cut in [1, 8, 67, doc.len() - 1] {
            assert!(decode_frames(&doc[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn pages_are_numbered_over_the_ranges_laid_end_to_end() {
        let l = RamLayout::new(vec![(0, 0x10000), (0x100000, 0x2000)]).unwrap();
        assert_eq!(l.pages(), 18);
        assert_eq!(l.page_of(0x1fff), Some(1));
        assert_eq!(l.page_of(0x100000), Some(16));
        assert_eq!(l.page_of(0x101fff), Some(17));
        assert_eq!(l.page_of(0x20000), None);
        assert_eq!(l.gpa_of(16), Some(0x100000));
        assert_eq!(l.gpa_of(18), None);
        for p in 0..l.pages() {
            assert_eq!(l.page_of(l.gpa_of(p).unwrap()), Some(p));
        }
        assert!(RamLayout::new(vec![(0, 0x2000), (0x1000, 0x1000)]).is_err());
        assert!(RamLayout::new(vec![(0x10, 0x1000)]).is_err());
    }
}
