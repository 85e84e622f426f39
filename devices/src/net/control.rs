//! virtio-net's control queue commands (virtio 1.2, 5.1.6.5), decoded from the bytes a
//! guest wrote, and the receive filter the RX and MAC commands set.
//!
//! Kept apart from the device so the guest-controlled parsing is small, pure and tested on
//! its own: the device only walks the chain, hands the bytes here and applies the result.

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_net::*;

/// Addresses each MAC table keeps; a longer table makes the filter take every address of
/// its kind, as QEMU's does, rather than be refused.
pub const MAC_TABLE_ENTRIES: usize = 64;

/// A command the device carries out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Promisc(bool),
    AllMulti(bool),
    MacTable {
        unicast: Vec<[u8; 6]>,
        multicast: Vec<[u8; 6]>,
    },
    /// How many queue pairs the driver uses from now on, 1 up to the device's.
    QueuePairs(u16),
}

/// Why a command was answered with VIRTIO_NET_ERR, for the debug log.
pub type Refusal = &'static str;

fn has(acked: u64, bit: u32) -> bool {
    acked & (1u64 << bit) != 0
}

/// The command in `bytes` (the chain's device-readable part: class, command, data), given
/// the features the driver accepted and the device's queue pairs.
pub fn decode(bytes: &[u8], acked: u64, max_pairs: u16) -> Result<Command, Refusal> {
    let [class, cmd, data @ ..] = bytes else {
        return Err("command shorter than its two-byte header");
    };
    let (class, cmd) = (u32::from(*class), u32::from(*cmd));
    match class {
        VIRTIO_NET_CTRL_RX | VIRTIO_NET_CTRL_MAC if !has(acked, VIRTIO_NET_F_CTRL_RX) => {
            Err("receive filter command without VIRTIO_NET_F_CTRL_RX")
        }
        VIRTIO_NET_CTRL_RX => {
            let &[on] = data else {
                return Err("receive mode command whose data is not one byte");
            };
            match cmd {
                VIRTIO_NET_CTRL_RX_PROMISC => Ok(Command::Promisc(on != 0)),
                VIRTIO_NET_CTRL_RX_ALLMULTI => Ok(Command::AllMulti(on != 0)),
                _ => Err("receive mode command not offered (no VIRTIO_NET_F_CTRL_RX_EXTRA)"),
            }
        }
        VIRTIO_NET_CTRL_MAC => match cmd {
            VIRTIO_NET_CTRL_MAC_TABLE_SET => {
                let (unicast, rest) = mac_table(data)?;
                let (multicast, rest) = mac_table(rest)?;
                if !rest.is_empty() {
                    return Err("bytes after the multicast MAC table");
                }
                Ok(Command::MacTable { unicast, multicast })
            }
            _ => Err("MAC command not offered (no VIRTIO_NET_F_CTRL_MAC_ADDR)"),
        },
        VIRTIO_NET_CTRL_MQ if !has(acked, VIRTIO_NET_F_MQ) => {
            Err("multiqueue command without VIRTIO_NET_F_MQ")
        }
        VIRTIO_NET_CTRL_MQ => match (cmd, data) {
            (VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET, &[lo, hi]) => {
                let pairs = u16::from_le_bytes([lo, hi]);
                if pairs == 0 || pairs > max_pairs {
                    return Err("queue pairs outside 1 to max_virtqueue_pairs");
                }
                Ok(Command::QueuePairs(pairs))
            }
            (VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET, _) => Err("VQ_PAIRS_SET whose data is not a le16"),
            _ => Err("multiqueue command not offered (no RSS or hash reporting)"),
        },
        _ => Err("command class not offered"),
    }
}

/// One MAC table (le32 count, then that many addresses) from the front of `data`, and what
/// follows it. Addresses past [`MAC_TABLE_ENTRIES`] are checked to be there but not kept.
fn mac_table(data: &[u8]) -> Result<(Vec<[u8; 6]>, &[u8]), Refusal> {
    let Some((count, rest)) = data.split_first_chunk::<4>() else {
        return Err("MAC table without its le32 entry count");
    };
    let count = u32::from_le_bytes(*count) as usize;
    let Some(len) = count.checked_mul(6).filter(|&len| len <= rest.len()) else {
        return Err("MAC table shorter than its entry count says");
    };
    let (entries, rest) = rest.split_at(len);
    let table = entries
        .chunks_exact(6)
        .map(|m| [m[0], m[1], m[2], m[3], m[4], m[5]])
        .collect();
    Ok((table, rest))
}

/// Which frames from the network reach the guest. Promiscuous after a reset, as QEMU's
/// device is: a driver that never sends a filter still gets every frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RxFilter {
    pub promisc: bool,
    pub allmulti: bool,
    /// Unicast addresses taken besides the device's own.
    pub unicast: Vec<[u8; 6]>,
    pub multicast: Vec<[u8; 6]>,
    /// The driver's unicast table was longer than [`MAC_TABLE_ENTRIES`]: all are taken.
    pub all_unicast: bool,
    /// The same for its multicast table.
    pub all_multicast: bool,
}

impl Default for RxFilter {
    fn default() -> Self {
        RxFilter {
            promisc: true,
            allmulti: false,
            unicast: Vec::new(),
            multicast: Vec::new(),
            all_unicast: false,
            all_multicast: false,
        }
    }
}

impl RxFilter {
    /// Replaces both tables; a table too long to keep takes every address of its kind.
    pub fn set_tables(&mut self, unicast: Vec<[u8; 6]>, multicast: Vec<[u8; 6]>) {
        self.all_unicast = unicast.len() > MAC_TABLE_ENTRIES;
        self.all_multicast = multicast.len() > MAC_TABLE_ENTRIES;
        self.unicast = unicast;
        self.unicast.truncate(MAC_TABLE_ENTRIES);
        self.multicast = multicast;
        self.multicast.truncate(MAC_TABLE_ENTRIES);
    }

    /// Whether a frame (Ethernet header first) goes to a guest whose MAC is `own`. A frame
    /// too short to have a destination is taken only in promiscuous mode.
    pub fn accepts(&self, own: &[u8; 6], frame: &[u8]) -> bool {
        if self.promisc {
            return true;
        }
        let Some(dest) = frame.first_chunk::<6>() else {
            return false;
        };
        if dest == &[0xff; 6] {
            true
        } else if dest[0] & 1 != 0 {
            self.allmulti || self.all_multicast || self.multicast.contains(dest)
        } else {
            dest == own || self.all_unicast || self.unicast.contains(dest)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: u64 =
        (1 << VIRTIO_NET_F_CTRL_VQ) | (1 << VIRTIO_NET_F_CTRL_RX) | (1 << VIRTIO_NET_F_MQ);

    fn table(entries: &[[u8; 6]]) -> Vec<u8> {
        let mut v = (entries.len() as u32).to_le_bytes().to_vec();
        entries.iter().for_each(|e| v.extend_from_slice(e));
        v
    }

    #[test]
    fn receive_modes_take_one_byte() {
        assert_eq!(decode(&[0, 0, 1], ALL, 1), Ok(Command::Promisc(true)));
        assert_eq!(decode(&[0, 0, 0], ALL, 1), Ok(Command::Promisc(false)));
        assert_eq!(decode(&[0, 1, 7], ALL, 1), Ok(Command::AllMulti(true)));
        for bad in [&[0u8, 0][..], &[0, 0, 1, 1], &[0, 2, 1], &[0], &[]] {
            assert!(decode(bad, ALL, 1).is_err(), "{bad:?}");
        }
        let no_rx = ALL & !(1 << VIRTIO_NET_F_CTRL_RX);
        assert!(decode(&[0, 0, 1], no_rx, 1).is_err());
    }

    #[test]
    fn mac_tables_must_hold_what_their_counts_say() {
        let a = [0x52, 0x54, 0, 0, 0, 1];
        let m = [0x33, 0x33, 0, 0, 0, 1];
        let cmd = [vec![1, 0], table(&[a]), table(&[m])].concat();
        assert_eq!(
            decode(&cmd, ALL, 1),
            Ok(Command::MacTable {
                unicast: vec![a],
                multicast: vec![m]
            })
        );
        let empty = [vec![1, 0], table(&[]), table(&[])].concat();
        assert!(decode(&empty, ALL, 1).is_ok());
        for bad in [
            [vec![1, 0], table(&[a])].concat(),
            [vec![1, 0], table(&[a]), table(&[m]), vec![0]].concat(),
            [vec![1, 0], table(&[a]), table(&[m])[..9].to_vec()].concat(),
            [vec![1, 0], u32::MAX.to_le_bytes().to_vec(), table(&[])].concat(),
            [vec![1, 1], a.to_vec()].concat(),
        ] {
            assert!(decode(&bad, ALL, 1).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn queue_pairs_are_one_up_to_the_devices_with_mq_only() {
        assert_eq!(decode(&[4, 0, 2, 0], ALL, 2), Ok(Command::QueuePairs(2)));
        assert_eq!(decode(&[4, 0, 1, 0], ALL, 2), Ok(Command::QueuePairs(1)));
        for bad in [
            &[4u8, 0, 0, 0][..],
            &[4, 0, 3, 0],
            &[4, 0, 2],
            &[4, 1, 2, 0],
        ] {
            assert!(decode(bad, ALL, 2).is_err(), "{bad:?}");
        }
        let no_mq = ALL & !(1 << VIRTIO_NET_F_MQ);
        assert!(decode(&[4, 0, 1, 0], no_mq, 2).is_err());
        for class in [2u8, 3, 5, 6, 8, 255] {
            assert!(decode(&[class, 0, 0, 0], ALL, 2).is_err(), "class {class}");
        }
    }

    #[test]
    fn the_filter_takes_what_the_driver_asked_for() {
        let own = [0x52, 0x54, 0, 0xab, 0xcd, 0xef];
        let other = [0x52, 0x54, 0, 1, 1, 1];
        let extra = [0x52, 0x54, 0, 2, 2, 2];
        let multi = [0x01, 0, 0x5e, 0, 0, 1];
        let multi2 = [0x33, 0x33, 0, 0, 0, 1];
        let mut f = RxFilter::default();
        for dest in [own, other, multi, [0xff; 6]] {
            assert!(f.accepts(&own, &dest), "promiscuous after reset");
        }
        assert!(f.accepts(&own, &[1, 2]));
        f.promisc = false;
        assert!(f.accepts(&own, &own));
        assert!(f.accepts(&own, &[0xff; 6]));
        assert!(!f.accepts(&own, &other));
        assert!(!f.accepts(&own, &multi));
        assert!(!f.accepts(&own, &own[..5]));
        f.set_tables(vec![extra], vec![multi]);
        assert!(f.accepts(&own, &extra));
        assert!(f.accepts(&own, &multi));
        assert!(!f.accepts(&own, &multi2));
        f.allmulti = true;
        assert!(f.accepts(&own, &multi2));
        assert!(!f.accepts(&own, &other));
        // Tables too long to keep take every address of their kind.
        f.allmulti = false;
        f.set_tables(vec![extra; MAC_TABLE_ENTRIES + 1], Vec::new());
        assert!(f.accepts(&own, &other));
        assert!(!f.accepts(&own, &multi));
        assert_eq!(f.unicast.len(), MAC_TABLE_ENTRIES);
    }
}
