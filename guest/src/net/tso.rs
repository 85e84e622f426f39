//! Lets smoltcp build TCP segments of up to 64 KiB and the device cut them (virtio-net's
//! `HOST_TSO4` and `CSUM`), as a Linux guest's stack does: the stack, the device, the
//! host's TAP and its stack then pay their per-packet work once per up to 64 KiB instead
//! of once per 1,460 bytes, and the host cuts a frame into segments only if it leaves
//! through a device that cannot take it whole.
//!
//! smoltcp (its `segmentation-offload`) sizes a segment by the window and its congestion
//! window instead of the peer's MSS when the device says it segments, and then tells the
//! transmit token the MSS to cut at. It leaves every TCP checksum to the device (it must:
//! the checksum of a segment the device makes is not one smoltcp could compute), so every
//! TCP frame goes with `NEEDS_CSUM` and the pseudo-header's sum in its checksum field.
//! A frame longer than a descriptor's 2 KiB buffer is built in a slot of its own.

use smoltcp::wire::{Ipv4Address, Ipv4Packet, TcpPacket};

use super::driver::store;

/// `virtio_net_hdr_v1` bytes before each frame.
const HDR: usize = 12;
/// Largest frame smoltcp is told it may hand over: the largest IPv4 packet and the
/// Ethernet header.
pub const MAX_FRAME: usize = 14 + 65_535;
/// Bytes of one slot: the header and the largest frame, rounded to pages.
pub const SLOT_BYTES: u64 = (HDR + MAX_FRAME).next_multiple_of(4096) as u64;
/// Large frames the device may hold at once (a `tcp-send` socket's 256 KiB transmit buffer
/// makes four); with all of them out, nothing is sent until one comes back.
pub const SLOTS: usize = 4;

const ETH: usize = 14;

const HDR_F_NEEDS_CSUM: u8 = 1;
const HDR_GSO_TCPV4: u8 = 1;
/// Where a TCP header's checksum field is.
const TCP_CSUM_OFFSET: u16 = 16;

pub struct Tso {
    base: u64,
    /// The descriptor each slot's frame is with the device under.
    busy: [Option<u16>; SLOTS],
    /// Frames the device was asked to cut, and the segments it will make of them.
    pub frames: u64,
    pub segments: u64,
}

impl Tso {
    /// Slots at `base` (`SLOTS` of `SLOT_BYTES`).
    pub fn new(base: u64) -> Tso {
        Tso {
            base,
            busy: [None; SLOTS],
            frames: 0,
            segments: 0,
        }
    }

    /// The device handed descriptor `id` back: the slot it held is free.
    pub fn done(&mut self, id: u16) {
        for b in &mut self.busy {
            if *b == Some(id) {
                *b = None;
            }
        }
    }

    /// True while a slot is free for a large frame.
    pub fn has_room(&self) -> bool {
        self.busy.iter().any(Option::is_none)
    }

    /// A free slot for a frame under descriptor `id`: the address of its header (the
    /// frame follows it), or `None` if every slot is with the device.
    pub fn claim(&mut self, id: u16) -> Option<u64> {
        let slot = self.busy.iter().position(Option::is_none)?;
        self.busy[slot] = Some(id);
        Some(self.base + slot as u64 * SLOT_BYTES)
    }

    /// Writes the virtio-net header at `hdr` for frame `f`: a TCP/IPv4 segment gets its
    /// checksum left to the device, and, if `mss` is given and it carries more than that,
    /// its segmentation; anything else a header that asks for nothing.
    pub fn header(&mut self, hdr: u64, f: &mut [u8], mss: Option<u16>) {
        store(hdr, 0u64);
        store(hdr + 8, 0u32);
        let Some((ip_len, tcp_len)) = tcp_ipv4(f) else {
            return;
        };
        let ip = Ipv4Packet::new_unchecked(&f[ETH..]);
        let pseudo = pseudo_header_sum(ip.src_addr(), ip.dst_addr(), tcp_len);
        let mut tcp = TcpPacket::new_unchecked(&mut f[ETH + ip_len..]);
        tcp.set_checksum(pseudo);
        let start = (ETH + ip_len) as u16;
        store(hdr, HDR_F_NEEDS_CSUM);
        store(hdr + 6, start.to_le());
        store(hdr + 8, TCP_CSUM_OFFSET.to_le());
        let thl = tcp.header_len() as usize;
        let payload = tcp_len.saturating_sub(thl);
        if let Some(mss) = mss.filter(|&m| m > 0 && payload > m as usize) {
            store(hdr + 1, HDR_GSO_TCPV4);
            store(hdr + 2, (start + thl as u16).to_le());
            store(hdr + 4, mss.to_le());
            self.frames += 1;
            self.segments += payload.div_ceil(mss as usize) as u64;
        }
    }
}

/// The IPv4 header's and the TCP segment's lengths of a TCP/IPv4 frame that is not a
/// fragment (the packet checked to fit the frame); `None` for anything else.
fn tcp_ipv4(f: &[u8]) -> Option<(usize, usize)> {
    if f.len() < ETH + 20 || f[12..14] != [0x08, 0x00] {
        return None;
    }
    let ip = Ipv4Packet::new_checked(&f[ETH..]).ok()?;
    if ip.version() != 4 || u8::from(ip.next_header()) != 6 || ip.more_frags() {
        return None;
    }
    if ip.frag_offset() != 0 {
        return None;
    }
    let ip_len = ip.header_len() as usize;
    // By the IPv4 length, not the frame's: padding after the packet is not the segment's.
    let tcp_len = (ip.total_len() as usize).saturating_sub(ip_len);
    (tcp_len >= 20).then_some((ip_len, tcp_len))
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
