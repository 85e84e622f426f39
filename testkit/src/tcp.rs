//! Listening sockets read from the kernel's `/proc/.../net/tcp` table: no connection is
//! made, so a program that counts or refuses strangers (a migration's destination) sees
//! none.

use std::net::Ipv4Addr;

/// Whether a socket listens on `addr:port` (IPv4) in the network namespace of the table at
/// `table` (`/proc/net/tcp`, or `/proc/PID/net/tcp` for another process's namespace).
pub fn listening_at(table: &str, addr: Ipv4Addr, port: u16) -> bool {
    std::fs::read_to_string(table).is_ok_and(|text| table_lists_listener(&text, addr, port))
}

/// A loopback port nothing listens on now (the kernel's pick of a free one), for a program
/// under test to listen on.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binding 127.0.0.1:0");
    l.local_addr().expect("a bound socket's address").port()
}

/// A migration's secret file `dir/name` of 32 bytes `byte`, mode 0600 as Musubi asks.
pub fn secret_file(dir: &std::path::Path, name: &str, byte: u8) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, [byte; 32]).expect("writing a secret file");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))
        .expect("making a secret file 0600");
    p
}

/// Whether a socket of this process's network namespace listens on 127.0.0.1:`port`.
pub fn listening_on_loopback(port: u16) -> bool {
    listening_at("/proc/net/tcp", Ipv4Addr::LOCALHOST, port)
}

/// Whether a socket of process `pid`'s network namespace listens on `addr:port`.
pub fn listening_in(pid: u32, addr: Ipv4Addr, port: u16) -> bool {
    listening_at(&format!("/proc/{pid}/net/tcp"), addr, port)
}

/// Whether the text of a `net/tcp` table has a socket in state LISTEN (0A) on `addr:port`;
/// the table writes the address as the hex of its in-memory (network order) word.
fn table_lists_listener(table: &str, addr: Ipv4Addr, port: u16) -> bool {
    let want = format!("{:08X}:{port:04X}", u32::from_le_bytes(addr.octets()));
    table.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 3 && f[1] == want && f[3] == "0A"
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "  sl  local_address rem_address   st tx_queue rx_queue
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000
   1: 0100007F:1F91 0100007F:9C40 01 00000000:00000000 00:00000000 00000000
";

    #[test]
    fn only_a_socket_in_listen_state_on_that_address_and_port_counts() {
        assert!(table_lists_listener(TABLE, Ipv4Addr::LOCALHOST, 8080));
        // Established, not listening.
        assert!(!table_lists_listener(TABLE, Ipv4Addr::LOCALHOST, 8081));
        assert!(!table_lists_listener(
            TABLE,
            Ipv4Addr::new(10, 0, 0, 1),
            8080
        ));
    }

    #[test]
    fn a_socket_this_test_opens_is_seen() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(listening_on_loopback(port));
        assert!(listening_in(std::process::id(), Ipv4Addr::LOCALHOST, port));
        drop(l);
        assert!(!listening_on_loopback(port));
    }
}
