//! What travels between nodes in one frame: a coherence message or a control message, with a
//! fixed little-endian layout behind a tag byte, decoded with bounds checks only.

use dsm::{DecodeError, Message};
use thiserror::Error;

/// A VM exit one node forwards to the node serving that I/O (port or MMIO access).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exit {
    pub vcpu: u32,
    pub space: IoSpace,
    pub write: bool,
    pub addr: u64,
    /// The bytes written, or for a read the length wanted (contents ignored). 1 to 8 bytes.
    pub data: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoSpace {
    Port,
    Mmio,
}

/// An interrupt raised on one node for a vCPU running on another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interrupt {
    /// A message-signalled interrupt, injected on the target with `KVM_SIGNAL_MSI`.
    Msi { address: u64, data: u32 },
    /// An inter-processor interrupt to one vCPU. `icr` is the low word of the sender's
    /// interrupt command register as written (vector, delivery mode, level, trigger), so INIT
    /// and STARTUP travel as faithfully as fixed interrupts; the destination is `vcpu`.
    Ipi { vcpu: u32, icr: u32 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Envelope {
    Dsm(Message),
    Exit(Exit),
    /// The result of a forwarded exit (for reads, the bytes read).
    ExitReply {
        vcpu: u32,
        data: Vec<u8>,
    },
    Interrupt(Interrupt),
    /// The VM is ending; `code` is the exit status the whole VM reports. A connection that
    /// closes after this is a peer that left, not one that was lost.
    Stop {
        code: i32,
    },
    /// Proof of life, sent by the transport on its own timer so that a peer can tell a slow
    /// node from a dead one; consumed by the receiving transport.
    Heartbeat {
        seq: u64,
    },
    /// A live migration's own message (`musubi-migration` gives the bytes their meaning),
    /// at most [`MAX_MIGRATION_BYTES`] long.
    Migration(Vec<u8>),
    /// The sender lost `node` and is ending because of it. Sent before the sender's links
    /// close, so that a peer reading the close next knows which loss came first: without
    /// it, a node that hears of the sender's close before the lost node's own names the
    /// wrong node. `why` is cut to [`MAX_WHY_BYTES`].
    Lost {
        node: u16,
        why: String,
    },
    /// A vCPU's move between nodes (`musubi-cluster` gives the bytes their meaning), at most
    /// [`MAX_MIGRATION_BYTES`] long.
    Move(Vec<u8>),
}

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum EnvelopeError {
    #[error("empty envelope")]
    Empty,
    #[error("unknown envelope tag {0:#04x} (known: 0x00..=0x08)")]
    Tag(u8),
    #[error("envelope tag {tag:#04x}: {why} ({len} bytes)")]
    Layout {
        tag: u8,
        len: usize,
        why: &'static str,
    },
    #[error("coherence message: {0}")]
    Dsm(#[from] DecodeError),
}

const T_DSM: u8 = 0;
const T_EXIT: u8 = 1;
const T_EXIT_REPLY: u8 = 2;
const T_INTERRUPT: u8 = 3;
const T_STOP: u8 = 4;
const T_HEARTBEAT: u8 = 5;
const T_MIGRATION: u8 = 6;
const T_LOST: u8 = 7;
const T_MOVE: u8 = 8;

/// Most bytes of the reason a [`Envelope::Lost`] carries.
pub const MAX_WHY_BYTES: usize = 512;

/// Most bytes one [`Envelope::Migration`] carries: what fits a link frame beside the tag,
/// the length word and the MAC, with room to spare.
pub const MAX_MIGRATION_BYTES: usize = 15 * 1024;

/// Largest access a forwarded exit carries (a 64-bit MMIO access).
pub const MAX_EXIT_DATA: usize = 8;

/// Bounds-checked reader over a byte slice.
struct Cursor<'a> {
    tag: u8,
    b: &'a [u8],
    len: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, why: &'static str) -> EnvelopeError {
        EnvelopeError::Layout {
            tag: self.tag,
            len: self.len,
            why,
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], EnvelopeError> {
        if self.b.len() < n {
            return Err(self.err("too short"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, EnvelopeError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, EnvelopeError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, EnvelopeError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn data(&mut self) -> Result<Vec<u8>, EnvelopeError> {
        let n = self.u8()? as usize;
        if n == 0 || n > MAX_EXIT_DATA {
            return Err(self.err("access size must be 1 to 8 bytes"));
        }
        Ok(self.take(n)?.to_vec())
    }
    fn end(&self) -> Result<(), EnvelopeError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(self.err("trailing bytes"))
        }
    }
}

fn push_data(out: &mut Vec<u8>, d: &[u8]) {
    let n = d.len().clamp(1, MAX_EXIT_DATA);
    out.push(n as u8);
    let mut buf = [0u8; MAX_EXIT_DATA];
    let k = d.len().min(n);
    buf[..k].copy_from_slice(&d[..k]);
    out.extend_from_slice(&buf[..n]);
}

impl Envelope {
    /// Short name for counters and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Envelope::Dsm(m) => m.name(),
            Envelope::Exit(_) => "exit",
            Envelope::ExitReply { .. } => "exit-reply",
            Envelope::Interrupt(_) => "interrupt",
            Envelope::Stop { .. } => "stop",
            Envelope::Heartbeat { .. } => "heartbeat",
            Envelope::Migration(_) => "migration",
            Envelope::Lost { .. } => "lost",
            Envelope::Move(_) => "move",
        }
    }

    /// Appends the encoding. Exit data longer than 8 bytes is cut to 8, and empty data is
    /// sent as one zero byte: the decoder accepts only 1 to 8.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Envelope::Dsm(m) => {
                out.push(T_DSM);
                m.encode(out);
            }
            Envelope::Exit(e) => {
                out.push(T_EXIT);
                out.extend_from_slice(&e.vcpu.to_le_bytes());
                out.push(match e.space {
                    IoSpace::Port => 0,
                    IoSpace::Mmio => 1,
                });
                out.push(e.write as u8);
                out.extend_from_slice(&e.addr.to_le_bytes());
                push_data(out, &e.data);
            }
            Envelope::ExitReply { vcpu, data } => {
                out.push(T_EXIT_REPLY);
                out.extend_from_slice(&vcpu.to_le_bytes());
                push_data(out, data);
            }
            Envelope::Interrupt(Interrupt::Msi { address, data }) => {
                out.push(T_INTERRUPT);
                out.push(0);
                out.extend_from_slice(&address.to_le_bytes());
                out.extend_from_slice(&data.to_le_bytes());
            }
            Envelope::Interrupt(Interrupt::Ipi { vcpu, icr }) => {
                out.push(T_INTERRUPT);
                out.push(1);
                out.extend_from_slice(&vcpu.to_le_bytes());
                out.extend_from_slice(&icr.to_le_bytes());
            }
            Envelope::Stop { code } => {
                out.push(T_STOP);
                out.extend_from_slice(&code.to_le_bytes());
            }
            Envelope::Heartbeat { seq } => {
                out.push(T_HEARTBEAT);
                out.extend_from_slice(&seq.to_le_bytes());
            }
            Envelope::Migration(bytes) | Envelope::Move(bytes) => {
                // Longer payloads are the sender's bug; they are cut rather than sent whole
                // into a frame the peer refuses.
                let n = bytes.len().min(MAX_MIGRATION_BYTES);
                out.push(if matches!(self, Envelope::Move(_)) {
                    T_MOVE
                } else {
                    T_MIGRATION
                });
                out.extend_from_slice(&(n as u16).to_le_bytes());
                out.extend_from_slice(&bytes[..n]);
            }
            Envelope::Lost { node, why } => {
                let mut n = why.len().min(MAX_WHY_BYTES);
                while !why.is_char_boundary(n) {
                    n -= 1;
                }
                out.push(T_LOST);
                out.extend_from_slice(&node.to_le_bytes());
                out.extend_from_slice(&(n as u16).to_le_bytes());
                out.extend_from_slice(&why.as_bytes()[..n]);
            }
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode(&mut v);
        v
    }

    pub fn decode(bytes: &[u8]) -> Result<Envelope, EnvelopeError> {
        let (&tag, rest) = bytes.split_first().ok_or(EnvelopeError::Empty)?;
        let mut c = Cursor {
            tag,
            b: rest,
            len: bytes.len(),
        };
        let env = match tag {
            T_DSM => return Ok(Envelope::Dsm(Message::decode(rest)?)),
            T_EXIT => {
                let vcpu = c.u32()?;
                let space = match c.u8()? {
                    0 => IoSpace::Port,
                    1 => IoSpace::Mmio,
                    _ => return Err(c.err("I/O space byte must be 0 (port) or 1 (MMIO)")),
                };
                let write = match c.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(c.err("direction byte must be 0 (read) or 1 (write)")),
                };
                let addr = c.u64()?;
                let data = c.data()?;
                Envelope::Exit(Exit {
                    vcpu,
                    space,
                    write,
                    addr,
                    data,
                })
            }
            T_EXIT_REPLY => {
                let vcpu = c.u32()?;
                let data = c.data()?;
                Envelope::ExitReply { vcpu, data }
            }
            T_INTERRUPT => match c.u8()? {
                0 => {
                    let address = c.u64()?;
                    let data = c.u32()?;
                    Envelope::Interrupt(Interrupt::Msi { address, data })
                }
                1 => {
                    let vcpu = c.u32()?;
                    let icr = c.u32()?;
                    Envelope::Interrupt(Interrupt::Ipi { vcpu, icr })
                }
                _ => return Err(c.err("interrupt kind must be 0 (MSI) or 1 (IPI)")),
            },
            T_STOP => Envelope::Stop {
                code: c.u32()? as i32,
            },
            T_HEARTBEAT => Envelope::Heartbeat { seq: c.u64()? },
            T_MIGRATION | T_MOVE => {
                let n = u16::from_le_bytes(c.take(2)?.try_into().expect("2 bytes")) as usize;
                if n > MAX_MIGRATION_BYTES {
                    return Err(c.err("payload longer than MAX_MIGRATION_BYTES"));
                }
                let bytes = c.take(n)?.to_vec();
                if tag == T_MOVE {
                    Envelope::Move(bytes)
                } else {
                    Envelope::Migration(bytes)
                }
            }
            T_LOST => {
                let node = u16::from_le_bytes(c.take(2)?.try_into().expect("2 bytes"));
                let n = u16::from_le_bytes(c.take(2)?.try_into().expect("2 bytes")) as usize;
                if n > MAX_WHY_BYTES {
                    return Err(c.err("reason longer than MAX_WHY_BYTES"));
                }
                let why = String::from_utf8(c.take(n)?.to_vec())
                    .map_err(|_| c.err("reason is not UTF-8"))?;
                Envelope::Lost { node, why }
            }
            t => return Err(EnvelopeError::Tag(t)),
        };
        c.end()?;
        Ok(env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsm::{Access, NodeId};

    fn all() -> Vec<Envelope> {
        vec![
            Envelope::Dsm(Message::Fetch {
                page: 3,
                access: Access::Write,
                requester: NodeId(1),
            }),
            Envelope::Dsm(Message::PageData {
                page: 9,
                access: Access::Read,
                data: dsm::types::zero_page(),
            }),
            Envelope::Exit(Exit {
                vcpu: 2,
                space: IoSpace::Mmio,
                write: true,
                addr: 0xd000_0000,
                data: vec![1, 2, 3, 4],
            }),
            Envelope::ExitReply {
                vcpu: 7,
                data: vec![0xff],
            },
            Envelope::Interrupt(Interrupt::Msi {
                address: 0xfee0_0000,
                data: 0x4041,
            }),
            // INIT, level assert: delivery mode 5 in bits 8..=10, level in bit 14.
            Envelope::Interrupt(Interrupt::Ipi {
                vcpu: 5,
                icr: 0x0000_4500,
            }),
            // STARTUP with vector 0x9a.
            Envelope::Interrupt(Interrupt::Ipi {
                vcpu: 1,
                icr: 0x0000_069a,
            }),
            Envelope::Stop { code: -3 },
            Envelope::Heartbeat { seq: u64::MAX },
            Envelope::Migration(vec![]),
            Envelope::Migration((0..MAX_MIGRATION_BYTES).map(|i| i as u8).collect()),
            Envelope::Move(vec![1, 2, 3]),
            Envelope::Lost {
                node: 2,
                why: "peer n2 at 127.0.0.1:1 closed the connection".into(),
            },
            Envelope::Lost {
                node: u16::MAX,
                why: String::new(),
            },
        ]
    }

    #[test]
    fn every_envelope_round_trips_and_every_cut_is_refused() {
        for e in all() {
            let b = e.to_bytes();
            assert_eq!(Envelope::decode(&b).unwrap(), e);
            for cut in 0..b.len() {
                assert!(Envelope::decode(&b[..cut]).is_err(), "{e:?} cut at {cut}");
            }
            let mut long = b.clone();
            long.push(0);
            assert!(
                Envelope::decode(&long).is_err(),
                "{e:?} with a trailing byte"
            );
        }
        assert_eq!(Envelope::decode(&[9]), Err(EnvelopeError::Tag(9)));
        // A migration payload says its length, and one longer than allowed is refused.
        let mut long = vec![T_MIGRATION];
        long.extend_from_slice(&((MAX_MIGRATION_BYTES + 1) as u16).to_le_bytes());
        long.resize(3 + MAX_MIGRATION_BYTES + 1, 0);
        assert!(matches!(
            Envelope::decode(&long),
            Err(EnvelopeError::Layout { .. })
        ));
        // A reason cut to its limit stays UTF-8, and one that is not UTF-8 is refused.
        let long_why = "é".repeat(MAX_WHY_BYTES);
        match Envelope::decode(
            &Envelope::Lost {
                node: 1,
                why: long_why,
            }
            .to_bytes(),
        ) {
            Ok(Envelope::Lost { why, .. }) => {
                assert!(why.len() <= MAX_WHY_BYTES && why.chars().all(|c| c == 'é'))
            }
            other => panic!("{other:?}"),
        }
        let bad = [T_LOST, 1, 0, 1, 0, 0xff];
        assert!(matches!(
            Envelope::decode(&bad),
            Err(EnvelopeError::Layout { .. })
        ));
        // An access size of 9 is refused, not read past.
        let bad = [T_EXIT_REPLY, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(matches!(
            Envelope::decode(&bad),
            Err(EnvelopeError::Layout { .. })
        ));
    }
}
