//! The virtio-vsock packet header (virtio 1.1, 5.10.6): its 44 little-endian bytes and the
//! values its fields take.

/// Bytes of `struct virtio_vsock_hdr`.
pub const HDR_LEN: usize = 44;
/// The host's context id; the guest's is in the config space, 0–2 are reserved.
pub const HOST_CID: u64 = 2;
/// `VIRTIO_VSOCK_TYPE_STREAM`, the only socket type this device carries.
pub const TYPE_STREAM: u16 = 1;

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// `SHUTDOWN` flags: the sender will receive no more, send no more.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;

/// `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`, the one event of the event queue.
pub const EVENT_TRANSPORT_RESET: u32 = 0;

/// A packet header. Every bit pattern parses: which values make sense is for the device to
/// decide, with the connection the packet names in hand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    /// Payload bytes after the header.
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    /// The sender's receive buffer for this connection.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from that buffer, ever (wrapping).
    pub fwd_cnt: u32,
}

impl Header {
    pub fn parse(b: &[u8; HDR_LEN]) -> Header {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u16_at = |i: usize| u16::from_le_bytes(b[i..i + 2].try_into().unwrap());
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    pub fn encode(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// The header of a reply on the same connection: ports and cids swapped.
    pub fn reply(&self, op: u16) -> Header {
        Header {
            src_cid: self.dst_cid,
            dst_cid: self.src_cid,
            src_port: self.dst_port,
            dst_port: self.src_port,
            type_: TYPE_STREAM,
            op,
            ..Header::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_at_the_spec_offsets() {
        let h = Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 0x1122_3344,
            dst_port: 52,
            len: 7,
            type_: TYPE_STREAM,
            op: OP_RW,
            flags: SHUTDOWN_SEND,
            buf_alloc: 65536,
            fwd_cnt: 0xdead_beef,
        };
        let b = h.encode();
        assert_eq!(&b[16..20], &0x1122_3344u32.to_le_bytes());
        assert_eq!(&b[30..32], &OP_RW.to_le_bytes());
        assert_eq!(&b[40..44], &0xdead_beefu32.to_le_bytes());
        assert_eq!(Header::parse(&b), h);
        let r = h.reply(OP_RST);
        assert_eq!(
            (r.src_cid, r.dst_cid, r.src_port, r.dst_port),
            (2, 3, 52, 0x1122_3344)
        );
        assert_eq!((r.op, r.type_, r.len), (OP_RST, TYPE_STREAM, 0));
    }
}
