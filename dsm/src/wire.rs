//! The messages nodes exchange, and their byte encoding.
//!
//! Layout: `version:u8, kind:u8`, then the fields of the kind in order, integers little-endian
//! and fixed-width (page `u64`, node `u16`, access `u8` 0 = read / 1 = write), then for a data
//! message exactly `PAGE_SIZE` bytes. A frame is exactly one message: framing over a stream is
//! the transport's job. Fixed widths keep the decoder a handful of bounds checks, and the
//! largest control message is 15 bytes.
//!
//! Decoding checks the structure only (version, kind, length, access byte); whether a node
//! id names a member of the VM, and whether the message makes sense now, is the state
//! machine's call.

use crate::types::{Access, NodeId, PageData, PageNo, PAGE_SIZE};
use thiserror::Error;

/// Bumped on any change of layout; a peer speaking another version is refused, never guessed.
pub const WIRE_VERSION: u8 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Paper: `⟨fetch, n, a, i⟩`, requester to manager.
    Fetch {
        page: PageNo,
        access: Access,
        requester: NodeId,
    },
    /// Paper: `⟨inv, n, a, s, o⟩`, manager to the owner (read) or to every copy (write);
    /// the node equal to `owner` answers `requester` with the page.
    Inv {
        page: PageNo,
        access: Access,
        requester: NodeId,
        owner: NodeId,
    },
    /// Paper: `⟨finish, n, a, i⟩`, requester to manager once the page is installed; clears
    /// the manager's busy flag.
    Finish {
        page: PageNo,
        access: Access,
        requester: NodeId,
    },
    /// Ivy: requester to manager.
    Req {
        page: PageNo,
        access: Access,
        requester: NodeId,
    },
    /// Ivy: manager to the owner (or the node about to become owner).
    Fwd {
        page: PageNo,
        access: Access,
        requester: NodeId,
    },
    /// Ivy: owner to a copy holder; answered by `InvalAck` before the owner lets go.
    Inval { page: PageNo },
    /// Ivy: copy holder to owner.
    InvalAck { page: PageNo },
    /// The page itself: the paper's `⟨ack, n, a, c⟩`, and Ivy's reply to a request.
    PageData {
        page: PageNo,
        access: Access,
        data: PageData,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("empty message")]
    Empty,
    #[error("wire version {0}, this build speaks version {WIRE_VERSION}")]
    Version(u8),
    #[error("unknown message kind {0:#04x} (known: 0x01..=0x08)")]
    Kind(u8),
    #[error("message kind {kind:#04x} is {expected} bytes long, got {got}")]
    Length {
        kind: u8,
        expected: usize,
        got: usize,
    },
    #[error("access byte {0:#04x} (0 = read, 1 = write)")]
    Access(u8),
}

const K_FETCH: u8 = 1;
const K_INV: u8 = 2;
const K_FINISH: u8 = 3;
const K_REQ: u8 = 4;
const K_FWD: u8 = 5;
const K_INVAL: u8 = 6;
const K_INVAL_ACK: u8 = 7;
const K_PAGE: u8 = 8;

/// Bytes after the two header bytes, by kind.
fn body_len(kind: u8) -> Option<usize> {
    Some(match kind {
        K_FETCH | K_FINISH | K_REQ | K_FWD => 8 + 1 + 2,
        K_INV => 8 + 1 + 2 + 2,
        K_INVAL | K_INVAL_ACK => 8,
        K_PAGE => 8 + 1 + PAGE_SIZE,
        _ => return None,
    })
}

impl Message {
    pub fn page(&self) -> PageNo {
        match self {
            Message::Fetch { page, .. }
            | Message::Inv { page, .. }
            | Message::Finish { page, .. }
            | Message::Req { page, .. }
            | Message::Fwd { page, .. }
            | Message::Inval { page }
            | Message::InvalAck { page }
            | Message::PageData { page, .. } => *page,
        }
    }

    /// Short name for traces and tables.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Fetch { .. } => "fetch",
            Message::Inv { .. } => "inv",
            Message::Finish { .. } => "finish",
            Message::Req { .. } => "req",
            Message::Fwd { .. } => "fwd",
            Message::Inval { .. } => "inval",
            Message::InvalAck { .. } => "inval-ack",
            Message::PageData { .. } => "page",
        }
    }

    fn kind(&self) -> u8 {
        match self {
            Message::Fetch { .. } => K_FETCH,
            Message::Inv { .. } => K_INV,
            Message::Finish { .. } => K_FINISH,
            Message::Req { .. } => K_REQ,
            Message::Fwd { .. } => K_FWD,
            Message::Inval { .. } => K_INVAL,
            Message::InvalAck { .. } => K_INVAL_ACK,
            Message::PageData { .. } => K_PAGE,
        }
    }

    pub fn encoded_len(&self) -> usize {
        2 + body_len(self.kind()).expect("every variant has a kind")
    }

    /// Appends the encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.reserve(self.encoded_len());
        out.push(WIRE_VERSION);
        out.push(self.kind());
        out.extend_from_slice(&self.page().to_le_bytes());
        let acc = |a: &Access| match a {
            Access::Read => 0u8,
            Access::Write => 1u8,
        };
        match self {
            Message::Fetch {
                access, requester, ..
            }
            | Message::Finish {
                access, requester, ..
            }
            | Message::Req {
                access, requester, ..
            }
            | Message::Fwd {
                access, requester, ..
            } => {
                out.push(acc(access));
                out.extend_from_slice(&requester.0.to_le_bytes());
            }
            Message::Inv {
                access,
                requester,
                owner,
                ..
            } => {
                out.push(acc(access));
                out.extend_from_slice(&requester.0.to_le_bytes());
                out.extend_from_slice(&owner.0.to_le_bytes());
            }
            Message::Inval { .. } | Message::InvalAck { .. } => {}
            Message::PageData { access, data, .. } => {
                out.push(acc(access));
                out.extend_from_slice(&data[..]);
            }
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode(&mut v);
        v
    }

    pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
        let (&version, rest) = bytes.split_first().ok_or(DecodeError::Empty)?;
        if version != WIRE_VERSION {
            return Err(DecodeError::Version(version));
        }
        let (&kind, body) = rest.split_first().ok_or(DecodeError::Length {
            kind: 0,
            expected: 2,
            got: bytes.len(),
        })?;
        let expected = body_len(kind).ok_or(DecodeError::Kind(kind))?;
        if body.len() != expected {
            return Err(DecodeError::Length {
                kind,
                expected: expected + 2,
                got: bytes.len(),
            });
        }
        let page = u64::from_le_bytes(body[0..8].try_into().expect("8 bytes"));
        let node = |at: usize| NodeId(u16::from_le_bytes([body[at], body[at + 1]]));
        let access = || match body[8] {
            0 => Ok(Access::Read),
            1 => Ok(Access::Write),
            b => Err(DecodeError::Access(b)),
        };
        Ok(match kind {
            K_FETCH => Message::Fetch {
                page,
                access: access()?,
                requester: node(9),
            },
            K_FINISH => Message::Finish {
                page,
                access: access()?,
                requester: node(9),
            },
            K_REQ => Message::Req {
                page,
                access: access()?,
                requester: node(9),
            },
            K_FWD => Message::Fwd {
                page,
                access: access()?,
                requester: node(9),
            },
            K_INV => Message::Inv {
                page,
                access: access()?,
                requester: node(9),
                owner: node(11),
            },
            K_INVAL => Message::Inval { page },
            K_INVAL_ACK => Message::InvalAck { page },
            K_PAGE => {
                let access = access()?;
                let mut data = crate::types::zero_page();
                data.copy_from_slice(&body[9..]);
                Message::PageData { page, access, data }
            }
            _ => return Err(DecodeError::Kind(kind)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Message> {
        let mut data = crate::types::zero_page();
        data[0] = 7;
        data[PAGE_SIZE - 1] = 9;
        vec![
            Message::Fetch {
                page: 1 << 40,
                access: Access::Write,
                requester: NodeId(3),
            },
            Message::Inv {
                page: 5,
                access: Access::Read,
                requester: NodeId(1),
                owner: NodeId(65535),
            },
            Message::Finish {
                page: 0,
                access: Access::Read,
                requester: NodeId(2),
            },
            Message::Req {
                page: u64::MAX,
                access: Access::Read,
                requester: NodeId(0),
            },
            Message::Fwd {
                page: 9,
                access: Access::Write,
                requester: NodeId(7),
            },
            Message::Inval { page: 3 },
            Message::InvalAck { page: 4 },
            Message::PageData {
                page: 11,
                access: Access::Write,
                data,
            },
        ]
    }

    #[test]
    fn every_kind_round_trips_at_its_stated_length() {
        for m in all() {
            let b = m.to_bytes();
            assert_eq!(b.len(), m.encoded_len());
            assert_eq!(Message::decode(&b).unwrap(), m);
        }
    }

    #[test]
    fn malformed_input_is_an_error() {
        assert_eq!(Message::decode(&[]), Err(DecodeError::Empty));
        assert_eq!(Message::decode(&[2, 1]), Err(DecodeError::Version(2)));
        assert!(matches!(
            Message::decode(&[1]),
            Err(DecodeError::Length { .. })
        ));
        assert_eq!(Message::decode(&[1, 0x99]), Err(DecodeError::Kind(0x99)));
        for m in all() {
            let b = m.to_bytes();
            for cut in 0..b.len() {
                assert!(Message::decode(&b[..cut]).is_err());
            }
            let mut long = b.clone();
            long.push(0);
            assert!(Message::decode(&long).is_err());
        }
        let mut b = all()[0].to_bytes();
        b[10] = 2;
        assert_eq!(Message::decode(&b), Err(DecodeError::Access(2)));
    }
}
