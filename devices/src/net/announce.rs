//! Telling the network where a guest moved to: the guest's IPv4 address as its own frames
//! show it, and the gratuitous ARP that makes bridges (and neighbours) learn the new port.
//!
//! The VMM announces the guest itself rather than asking the guest to
//! (`VIRTIO_NET_F_GUEST_ANNOUNCE`): the announcement then goes out before the guest runs,
//! needs nothing of the guest's driver (any guest, ours or Linux, with or without that
//! feature), and the failover's first reply does not wait for the guest to be scheduled and
//! answer a configuration interrupt. The price is learning the address from what the guest
//! sends, which a guest that never sent anything has not shown; the announcement then still
//! goes out, with the unspecified address, and a bridge learns the MAC from it all the same.

use std::net::Ipv4Addr;

const ETH_HDR: usize = 14;
const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_ARP: u16 = 0x0806;

/// The IPv4 address a frame the guest sent (Ethernet header first) shows the guest to have:
/// the source of an IPv4 packet, or the sender of an ARP packet, when the frame comes from
/// `mac` and the address is a unicast one (not unspecified, broadcast or multicast).
pub fn sender_ipv4(frame: &[u8], mac: &[u8; 6]) -> Option<Ipv4Addr> {
    if frame.len() < ETH_HDR || frame[6..12] != mac[..] {
        return None;
    }
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let body = &frame[ETH_HDR..];
    let ip: [u8; 4] = match ethertype {
        ETHERTYPE_IPV4 if body.len() >= 20 && body[0] >> 4 == 4 => body[12..16].try_into().ok()?,
        // Ethernet/IPv4 ARP: hardware type 1, protocol 0x0800, lengths 6 and 4.
        ETHERTYPE_ARP if body.len() >= 28 && body[..6] == [0, 1, 8, 0, 6, 4] => {
            body[14..18].try_into().ok()?
        }
        _ => return None,
    };
    let ip = Ipv4Addr::from(ip);
    (!ip.is_unspecified() && !ip.is_broadcast() && !ip.is_multicast()).then_some(ip)
}

/// A gratuitous ARP request (RFC 5227's announcement) from `mac` for `ip`, to the
/// broadcast address: sender and target address both `ip`.
pub fn gratuitous_arp(mac: &[u8; 6], ip: Ipv4Addr) -> [u8; 42] {
    let mut f = [0u8; 42];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(mac);
    f[12..14].copy_from_slice(&ETHERTYPE_ARP.to_be_bytes());
    f[14..22].copy_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
    f[22..28].copy_from_slice(mac);
    f[28..32].copy_from_slice(&ip.octets());
    f[38..42].copy_from_slice(&ip.octets());
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [0x52, 0x54, 0, 1, 2, 3];

    #[test]
    fn the_address_comes_from_the_guests_own_arp_and_ipv4_frames() {
        let ip = Ipv4Addr::new(10, 0, 0, 2);
        let arp = gratuitous_arp(&MAC, ip);
        assert_eq!(sender_ipv4(&arp, &MAC), Some(ip));
        assert_eq!(
            sender_ipv4(&arp, &[0x52, 0, 0, 0, 0, 1]),
            None,
            "another MAC"
        );
        let mut v4 = [0u8; 34];
        v4[6..12].copy_from_slice(&MAC);
        v4[12..14].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        v4[14] = 0x45;
        v4[26..30].copy_from_slice(&[10, 0, 0, 7]);
        assert_eq!(sender_ipv4(&v4, &MAC), Some(Ipv4Addr::new(10, 0, 0, 7)));
        v4[26..30].copy_from_slice(&[0, 0, 0, 0]);
        assert_eq!(
            sender_ipv4(&v4, &MAC),
            None,
            "a DHCP client's unspecified source"
        );
        assert_eq!(sender_ipv4(&v4[..20], &MAC), None, "truncated");
    }

    #[test]
    fn the_announcement_is_a_broadcast_arp_request_for_the_address() {
        let f = gratuitous_arp(&MAC, Ipv4Addr::new(192, 168, 7, 9));
        assert_eq!(f[..6], [0xff; 6]);
        assert_eq!(f[12..14], [8, 6]);
        assert_eq!(f[20..22], [0, 1], "a request");
        assert_eq!(f[22..28], MAC);
        assert_eq!(f[28..32], f[38..42]);
        assert_eq!(f[32..38], [0; 6]);
    }
}
