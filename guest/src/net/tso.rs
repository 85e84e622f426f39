//! Hands the device one large TCP frame (virtio-net's `HOST_TSO4`) in place of the run of
//! full-sized segments of one flow that smoltcp sends in one poll, as a Linux guest's stack
//! does: the device, the host's TAP and its stack then pay their per-packet work once per
//! up to 64 KiB instead of once per 1,460 bytes, and the host cuts the frame into segments
//! only if it leaves through a device that cannot take it whole.
//!
//! A frame is built in a slot of its own (the descriptor buffers hold 2 KiB): the first
//! segment whole, then the payload of each that follows on (same addresses and ports,
//! sequence number next, same acknowledgement and window, ACK and at most PSH set, the same
//! payload length but for a shorter last one). When it goes, the IPv4 length and checksum
//! are rewritten for the whole, the TCP checksum field is set to the pseudo-header's sum
//! and the virtio-net header asks the device to finish it (`NEEDS_CSUM`, `GSO_TCPV4`,
//! `gso_size` the segments' payload). A single segment goes as smoltcp made it.

use smoltcp::wire::{Ipv4Address, Ipv4Packet, TcpPacket};

use super::driver::{load, store};

/// `virtio_net_hdr_v1` bytes before each frame.
const HDR: usize = 12;
/// Largest IPv4 packet, plus the Ethernet header.
const MAX_FRAME: usize = 14 + 65_535;
/// Bytes of one slot: the header and the largest frame, rounded to pages.
pub const SLOT_BYTES: u64 = (HDR + MAX_FRAME).next_multiple_of(4096) as u64;
/// Frames the device may hold at once; past them segments go one by one.
pub const SLOTS: usize = 4;

const ETH: usize = 14;
const IP: usize = ETH;
const TCP: usize = IP + 20;
const TCP_ACK: u8 = 0x10;
const TCP_PSH: u8 = 0x08;

const HDR_F_NEEDS_CSUM: u8 = 1;
const HDR_GSO_TCPV4: u8 = 1;

/// The frame under construction.
#[derive(Clone, Copy)]
struct Open {
    slot: usize,
    /// Descriptor it goes under: the first segment's.
    id: u16,
    /// Frame bytes in the slot (after the header).
    len: usize,
    segs: u32,
    /// Payload bytes of each segment but the last.
    mss: usize,
    /// TCP header length.
    thl: usize,
    next_seq: u32,
    /// A shorter segment ended it: nothing more may follow.
    closed: bool,
}

pub struct Tso {
    base: u64,
    /// The descriptor each slot's frame is with the device under.
    busy: [Option<u16>; SLOTS],
    open: Option<Open>,
    /// Frames of more than one segment handed to the device, and the segments in them.
    pub frames: u64,
    pub merged: u64,
}

/// What [`Tso::take`] did with a frame.
pub enum Took {
    /// Kept (copied): its descriptor is free again.
    Kept,
    /// Kept as the first of a new frame, which goes under its descriptor.
    Started,
    /// Not a segment that can be merged (or no slot is free): send it as it is, after
    /// [`Tso::flush`].
    No,
}

impl Tso {
    /// Slots at `base` (`SLOTS` of `SLOT_BYTES`).
    pub fn new(base: u64) -> Tso {
        Tso {
            base,
            busy: [None; SLOTS],
            open: None,
            frames: 0,
            merged: 0,
        }
    }

    fn slot(&self, slot: usize) -> u64 {
        self.base + slot as u64 * SLOT_BYTES
    }

    /// The device handed descriptor `id` back: the slot it held is free.
    pub fn done(&mut self, id: u16) {
        for b in &mut self.busy {
            if *b == Some(id) {
                *b = None;
            }
        }
    }

    /// Offers the frame `f` (without the virtio-net header) that smoltcp wrote into
    /// descriptor `id`'s buffer.
    pub fn take(&mut self, id: u16, f: &[u8]) -> Took {
        let Some(seg) = Segment::of(f) else {
            return Took::No;
        };
        if let Some(o) = self.open {
            let base = self.slot(o.slot) + HDR as u64;
            let head = |at: usize| load::<u8>(base + at as u64);
            let same = |from: usize, to: usize| (from..to).all(|i| head(i) == f[i]);
            let follows = !o.closed
                && seg.thl == o.thl
                && seg.seq == o.next_seq
                && seg.payload <= o.mss
                && o.len + seg.payload <= MAX_FRAME
                // Addresses (Ethernet, IP) and ports; acknowledgement and window.
                && same(0, 12)
                && same(IP + 12, TCP + 4)
                && same(TCP + 8, TCP + 12)
                && same(TCP + 14, TCP + 16);
            if follows {
                copy_to(base + o.len as u64, &f[ETH + 20 + seg.thl..]);
                if seg.flags & TCP_PSH != 0 {
                    store(base + (TCP + 13) as u64, head(TCP + 13) | TCP_PSH);
                }
                self.open = Some(Open {
                    len: o.len + seg.payload,
                    segs: o.segs + 1,
                    next_seq: seg.seq.wrapping_add(seg.payload as u32),
                    closed: seg.payload < o.mss,
                    ..o
                });
                return Took::Kept;
            }
            return Took::No;
        }
        let Some(slot) = (0..SLOTS).find(|&s| self.busy[s].is_none()) else {
            return Took::No;
        };
        let at = self.slot(slot);
        copy_to(at, &[0; HDR]);
        copy_to(at + HDR as u64, f);
        self.busy[slot] = Some(id);
        self.open = Some(Open {
            slot,
            id,
            len: f.len(),
            segs: 1,
            mss: seg.payload,
            thl: seg.thl,
            next_seq: seg.seq.wrapping_add(seg.payload as u32),
            closed: false,
        });
        Took::Started
    }

    /// Finishes the frame under construction, if any: its descriptor, buffer address and
    /// length, to be offered.
    pub fn flush(&mut self) -> Option<(u16, u64, u32)> {
        let o = self.open.take()?;
        let at = self.slot(o.slot);
        let frame = at + HDR as u64;
        if o.segs > 1 {
            // SAFETY: the slot is this frame's and not yet with the device, and its `len`
            // bytes were written by `take`.
            let f = unsafe { core::slice::from_raw_parts_mut(frame as *mut u8, o.len) };
            let mut ip = Ipv4Packet::new_unchecked(&mut f[IP..]);
            ip.set_total_len((o.len - IP) as u16);
            ip.fill_checksum();
            let (src, dst) = (ip.src_addr(), ip.dst_addr());
            let pseudo = pseudo_header_sum(src, dst, o.len - TCP);
            TcpPacket::new_unchecked(&mut f[TCP..]).set_checksum(pseudo);
            store(at, HDR_F_NEEDS_CSUM);
            store(at + 1, HDR_GSO_TCPV4);
            store(at + 2, ((TCP + o.thl) as u16).to_le());
            store(at + 4, (o.mss as u16).to_le());
            store(at + 6, (TCP as u16).to_le());
            store(at + 8, 16u16.to_le());
            self.frames += 1;
            self.merged += o.segs as u64;
        }
        Some((o.id, at, (HDR + o.len) as u32))
    }
}

/// The fields of a TCP/IPv4 data segment that merging looks at.
struct Segment {
    thl: usize,
    seq: u32,
    payload: usize,
    flags: u8,
}

impl Segment {
    /// A segment that may be merged: IPv4 without options or fragments, TCP with payload
    /// and only ACK (and PSH) set.
    fn of(f: &[u8]) -> Option<Segment> {
        if f.len() < TCP + 20 || f[12..14] != [0x08, 0x00] || f[IP] != 0x45 || f[IP + 9] != 6 {
            return None;
        }
        // More fragments, or an offset: a fragment.
        if f[IP + 6] & 0x3f != 0 || f[IP + 7] != 0 {
            return None;
        }
        let total = u16::from_be_bytes([f[IP + 2], f[IP + 3]]) as usize;
        let thl = ((f[TCP + 12] >> 4) as usize) * 4;
        let flags = f[TCP + 13];
        if total + ETH != f.len() || thl < 20 || 20 + thl >= total || flags & !TCP_PSH != TCP_ACK {
            return None;
        }
        Some(Segment {
            thl,
            seq: u32::from_be_bytes([f[TCP + 4], f[TCP + 5], f[TCP + 6], f[TCP + 7]]),
            payload: total - 20 - thl,
            flags,
        })
    }
}

/// The one's-complement sum of TCP's IPv4 pseudo-header, folded and not inverted: the
/// device adds the segment's to it and inverts (smoltcp keeps its own to itself).
fn pseudo_header_sum(src: Ipv4Address, dst: Ipv4Address, tcp_len: usize) -> u16 {
    let [a, b, c, d] = src.octets();
    let [e, f, g, h] = dst.octets();
    let mut s = [[a, b], [c, d], [e, f], [g, h]]
        .iter()
        .map(|w| u16::from_be_bytes(*w) as u32)
        .sum::<u32>()
        + 6
        + tcp_len as u32;
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// Copies `bytes` into a slot at `at`, which the device does not hold.
fn copy_to(at: u64, bytes: &[u8]) {
    // SAFETY: `at` lies in a slot this driver carved for itself, not with the device (its
    // `busy` entry is this frame's, not yet offered), with room for `bytes` (checked
    // against `MAX_FRAME` by the callers); `bytes` is smoltcp's frame in another buffer.
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), at as *mut u8, bytes.len()) }
}
