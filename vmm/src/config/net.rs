//! `--net`: one network device as the user asks for it, in Cloud Hypervisor's keys where
//! they exist, checked before any TAP is opened.

use super::spec::{self, Spec};
use super::ConfigError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

pub const NET_SYNTAX: &str = "tap=NAME|fd=N[:N...][,ip=ADDR,mask=MASK][,mac=MAC]\
[,num_queues=Q][,queue_size=N][,rate=BYTES_PER_S[/PACKETS_PER_S]]";

/// Keys of `--net`; Cloud Hypervisor's own where it has them (`tap`, `ip`, `mask`, `mac`,
/// `fd`, `num_queues`, `queue_size`), so a command line carries over.
const KEYS: [&str; 8] = [
    "tap",
    "ip",
    "mask",
    "mac",
    "fd",
    "num_queues",
    "queue_size",
    "rate",
];

/// Queues when not given: one receive and one transmit queue, Cloud Hypervisor's default.
pub const DEFAULT_NUM_QUEUES: u16 = 2;
/// Most queues (receive and transmit together) a device takes: two per queue pair, up to
/// the device's bound on pairs.
pub const MAX_NUM_QUEUES: u16 = 2 * devices::virtio::net::MAX_QUEUE_PAIRS;

/// Ring size when not given: Cloud Hypervisor's and Firecracker's default.
pub const DEFAULT_QUEUE_SIZE: u16 = 256;

/// Why a `mac=` value is not a device's MAC address.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MacError {
    #[error("expected six hexadecimal bytes separated by colons")]
    NotSixBytes,
    #[error("{0:?} is not two hexadecimal digits")]
    NotTwoDigits(String),
    #[error("{0:?} is not hexadecimal")]
    NotHex(String),
    #[error("a multicast address (lowest bit of the first byte set) cannot name a device")]
    Multicast,
}

/// Why a `rate=` value is not a limit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RateError {
    #[error("bytes per second: {0}")]
    Bytes(host_resources::SizeError),
    #[error("packets per second {0:?} is not a whole number")]
    Packets(String),
    #[error("a rate of zero would stop all traffic")]
    Zero,
    #[error("give bytes per second, packets per second, or both")]
    Empty,
}

/// Why a network device cannot be set up as given; each names the key or device.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NetError {
    #[error("give tap=NAME or fd=N")]
    NoTap,
    #[error("fd={0}: descriptor {1} is given twice")]
    FdTwice(Fds, i32),
    #[error("tap= and fd= name the TAP twice; give one")]
    TapTwice,
    #[error("fd={0} is standard input, output or error, not a TAP")]
    StdFd(i32),
    #[error("mask= without ip=")]
    MaskWithoutIp,
    #[error(
        "ip= configures a TAP Musubi opens by name; with fd= the orchestrator owns its addresses"
    )]
    IpWithFd,
    #[error("queue_size={size} must be a power of two from 2 to {max}", max = devices::virtio::QUEUE_MAX_SIZE)]
    QueueSize { size: u16 },
    #[error(
        "num_queues={0} must be an even number from 2 to {MAX_NUM_QUEUES} (a receive and a \
         transmit queue per pair)"
    )]
    NumQueues(u16),
    #[error(
        "num_queues={n} with fd={fds}: each handed-over descriptor is one TAP queue, so one \
         queue pair (num_queues={want})",
        want = fds.queues()
    )]
    NumQueuesWithFd { n: u16, fds: Fds },
    #[error("{0} is given twice; each network device needs a TAP of its own")]
    Twice(String),
    #[error("tap={0:?}: an interface name is 1 to 15 bytes")]
    IfnameLength(String),
    #[error("tap={0:?}: an interface name has no '/', ':' or white space and is not . or ..")]
    IfnameChars(String),
}

/// TAP queues an orchestrator opened and handed down, one per queue pair, written
/// `3:4:5` (as QEMU's `fds=`); the JSON config takes a number or a list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fds(pub Vec<i32>);

impl Fds {
    /// The receive and transmit queues these make (`num_queues`): a pair per descriptor.
    pub fn queues(&self) -> u16 {
        u16::try_from(2 * self.0.len()).unwrap_or(u16::MAX)
    }
}

impl FromStr for Fds {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.split(':')
            .map(|d| {
                d.parse::<i32>()
                    .map_err(|_| format!("{d:?} is not a descriptor number"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Fds)
    }
}

impl fmt::Display for Fds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(i32::to_string).collect();
        f.write_str(&parts.join(":"))
    }
}

impl Serialize for Fds {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.serialize_i32(*one),
            many => many.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Fds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(i32),
            Many(Vec<i32>),
        }
        Ok(Fds(match OneOrMany::deserialize(d)? {
            OneOrMany::One(fd) => vec![fd],
            OneOrMany::Many(fds) => fds,
        }))
    }
}

/// A MAC address, written `52:54:00:12:34:56`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl FromStr for MacAddr {
    type Err = MacError;
    fn from_str(s: &str) -> Result<Self, MacError> {
        let mut b = [0u8; 6];
        let parts: Vec<&str> = s.split(':').collect();
        if parts.len() != 6 {
            return Err(MacError::NotSixBytes);
        }
        for (o, p) in b.iter_mut().zip(parts) {
            if p.len() != 2 {
                return Err(MacError::NotTwoDigits(p.into()));
            }
            *o = u8::from_str_radix(p, 16).map_err(|_| MacError::NotHex(p.into()))?;
        }
        if b[0] & 1 != 0 {
            return Err(MacError::Multicast);
        }
        Ok(MacAddr(b))
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

impl Serialize for MacAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        spec::from_str(d)
    }
}

/// A token-bucket limit per direction: at most `bytes` bytes and `packets` packets a
/// second, each bucket a second deep (Firecracker's bucket with a refill time of 1000 ms).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateLimit {
    pub bytes_per_s: Option<u64>,
    pub packets_per_s: Option<u64>,
}

impl FromStr for RateLimit {
    type Err = RateError;
    fn from_str(s: &str) -> Result<Self, RateError> {
        let (bytes, packets) = match s.split_once('/') {
            Some((b, p)) => (b, Some(p)),
            None => (s, None),
        };
        let bytes_per_s = match bytes {
            "" => None,
            b => Some(host_resources::parse_size("rate", b).map_err(|e| RateError::Bytes(e.why))?),
        };
        let packets_per_s = match packets {
            None | Some("") => None,
            Some(p) => Some(p.parse::<u64>().map_err(|_| RateError::Packets(p.into()))?),
        };
        if bytes_per_s == Some(0) || packets_per_s == Some(0) {
            return Err(RateError::Zero);
        }
        if bytes_per_s.is_none() && packets_per_s.is_none() {
            return Err(RateError::Empty);
        }
        Ok(RateLimit {
            bytes_per_s,
            packets_per_s,
        })
    }
}

/// The flag's own form, so a saved configuration (a snapshot's) reads back.
impl fmt::Display for RateLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(b) = self.bytes_per_s {
            write!(f, "{b}")?;
        }
        if let Some(p) = self.packets_per_s {
            write!(f, "/{p}")?;
        }
        Ok(())
    }
}

impl Serialize for RateLimit {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for RateLimit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        spec::from_str(d)
    }
}

/// One `--net`, or one entry of the JSON config's `net`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// The TAP interface: opened if it exists, created if not.
    #[serde(default)]
    pub tap: Option<String>,
    /// The queues of a TAP an orchestrator already opened and passed down (`IFF_VNET_HDR`
    /// set; several must be queues of one `IFF_MULTI_QUEUE` TAP), one per queue pair.
    #[serde(default)]
    pub fd: Option<Fds>,
    /// The host end's address, given to a TAP Musubi creates.
    #[serde(default)]
    pub ip: Option<Ipv4Addr>,
    #[serde(default)]
    pub mask: Option<Ipv4Addr>,
    /// The guest's MAC; a locally administered one is made up when not given.
    #[serde(default)]
    pub mac: Option<MacAddr>,
    /// Receive and transmit queues together, as Cloud Hypervisor counts them: twice the
    /// queue pairs, each pair a queue of the TAP.
    #[serde(default = "default_num_queues")]
    pub num_queues: u16,
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    #[serde(default)]
    pub rate: Option<RateLimit>,
}

fn default_queue_size() -> u16 {
    DEFAULT_QUEUE_SIZE
}

fn default_num_queues() -> u16 {
    DEFAULT_NUM_QUEUES
}

impl NetConfig {
    /// The refusals that need no spec text: what the JSON form must obey as well.
    pub fn check(&self) -> Result<(), NetError> {
        match (&self.tap, &self.fd) {
            (None, None) => return Err(NetError::NoTap),
            (Some(_), Some(_)) => return Err(NetError::TapTwice),
            (Some(t), None) => check_ifname(t)?,
            (None, Some(fds)) => {
                for (i, &fd) in fds.0.iter().enumerate() {
                    if fd < 3 {
                        return Err(NetError::StdFd(fd));
                    }
                    if fds.0[..i].contains(&fd) {
                        return Err(NetError::FdTwice(fds.clone(), fd));
                    }
                }
            }
        }
        if self.mask.is_some() && self.ip.is_none() {
            return Err(NetError::MaskWithoutIp);
        }
        if self.ip.is_some() && self.fd.is_some() {
            return Err(NetError::IpWithFd);
        }
        let q = self.queue_size;
        if !(2..=devices::virtio::QUEUE_MAX_SIZE).contains(&q) || !q.is_power_of_two() {
            return Err(NetError::QueueSize { size: q });
        }
        let n = self.num_queues;
        if !(2..=MAX_NUM_QUEUES).contains(&n) || !n.is_multiple_of(2) {
            return Err(NetError::NumQueues(n));
        }
        if let Some(fds) = &self.fd {
            if n != fds.queues() {
                return Err(NetError::NumQueuesWithFd {
                    n,
                    fds: fds.clone(),
                });
            }
        }
        Ok(())
    }

    /// Receive and transmit queue pairs: one TAP queue each.
    pub fn queue_pairs(&self) -> usize {
        usize::from(self.num_queues / 2)
    }

    /// How messages name this device: its TAP, or the descriptor it came as.
    pub fn name(&self) -> String {
        match (&self.tap, &self.fd) {
            (Some(t), _) => format!("--net tap={t}"),
            (None, Some(fds)) => format!("--net fd={fds}"),
            (None, None) => "--net".into(),
        }
    }
}

/// Refuses two devices on one TAP: one descriptor would be owned (and closed) twice, and a
/// TAP opened twice by name fails with a less helpful EBUSY.
pub fn check_distinct(nets: &[NetConfig]) -> Result<(), NetError> {
    for (i, a) in nets.iter().enumerate() {
        for b in &nets[..i] {
            let same_tap = a.tap.is_some() && a.tap == b.tap;
            let same_fd = match (&a.fd, &b.fd) {
                (Some(x), Some(y)) => x.0.iter().any(|fd| y.0.contains(fd)),
                _ => false,
            };
            if same_tap || same_fd {
                return Err(NetError::Twice(a.name()));
            }
        }
    }
    Ok(())
}

/// Linux's rules for an interface name: 1 to 15 bytes, no slash, no white space, not `.`
/// or `..`.
fn check_ifname(name: &str) -> Result<(), NetError> {
    if name.is_empty() || name.len() > 15 {
        return Err(NetError::IfnameLength(name.into()));
    }
    if name == "."
        || name == ".."
        || name.contains(['/', ':'])
        || name.contains(char::is_whitespace)
    {
        return Err(NetError::IfnameChars(name.into()));
    }
    Ok(())
}

impl FromStr for NetConfig {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        let spec = Spec::parse("--net", NET_SYNTAX, text, &KEYS)?;
        let fd: Option<Fds> = spec.value("fd")?;
        // Handed-over queues say how many pairs there are; num_queues= may still say it.
        let fd_queues = fd.as_ref().map(Fds::queues);
        let c = NetConfig {
            tap: spec.get("tap").map(str::to_string),
            fd,
            ip: spec.value("ip")?,
            mask: spec.value("mask")?,
            mac: spec.value("mac")?,
            num_queues: spec
                .value("num_queues")?
                .or(fd_queues)
                .unwrap_or(DEFAULT_NUM_QUEUES),
            queue_size: spec.value("queue_size")?.unwrap_or(DEFAULT_QUEUE_SIZE),
            rate: spec.value("rate")?,
        };
        c.check().map_err(|why| spec.error(why.to_string()))?;
        Ok(c)
    }
}

/// The flag's own form, defaults left out, so a command line made from a parsed `--net`
/// parses back to the same device.
impl fmt::Display for NetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut pairs: Vec<(&str, String)> = Vec::new();
        if let Some(t) = &self.tap {
            pairs.push(("tap", t.clone()));
        }
        if let Some(fds) = &self.fd {
            pairs.push(("fd", fds.to_string()));
        }
        if let Some(ip) = self.ip {
            pairs.push(("ip", ip.to_string()));
        }
        if let Some(mask) = self.mask {
            pairs.push(("mask", mask.to_string()));
        }
        if let Some(mac) = self.mac {
            pairs.push(("mac", mac.to_string()));
        }
        // Handed-over queues imply their count, as parsing assumes.
        let implied = self.fd.as_ref().map_or(DEFAULT_NUM_QUEUES, Fds::queues);
        if self.num_queues != implied {
            pairs.push(("num_queues", self.num_queues.to_string()));
        }
        if self.queue_size != DEFAULT_QUEUE_SIZE {
            pairs.push(("queue_size", self.queue_size.to_string()));
        }
        if let Some(rate) = self.rate {
            pairs.push(("rate", rate.to_string()));
        }
        for (i, (key, value)) in pairs.iter().enumerate() {
            let comma = if i == 0 { "" } else { "," };
            write!(f, "{comma}{key}={value}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_specs_parse_with_cloud_hypervisors_keys() {
        let n: NetConfig = "tap=tap0,ip=10.0.0.1,mask=255.255.255.0,mac=52:54:00:12:34:56"
            .parse()
            .unwrap();
        assert_eq!(n.tap.as_deref(), Some("tap0"));
        assert_eq!(n.ip, Some(Ipv4Addr::new(10, 0, 0, 1)));
        assert_eq!(n.mask, Some(Ipv4Addr::new(255, 255, 255, 0)));
        assert_eq!(n.mac, Some(MacAddr([0x52, 0x54, 0, 0x12, 0x34, 0x56])));
        assert_eq!(n.queue_size, DEFAULT_QUEUE_SIZE);
        assert_eq!(n.mac.unwrap().to_string(), "52:54:00:12:34:56");
        let n: NetConfig = "fd=7,queue_size=64,rate=10M/5000".parse().unwrap();
        assert_eq!(n.fd, Some(Fds(vec![7])));
        assert_eq!(n.queue_size, 64);
        assert_eq!(
            n.rate,
            Some(RateLimit {
                bytes_per_s: Some(10 << 20),
                packets_per_s: Some(5000)
            })
        );
        let n: NetConfig = "tap=t,rate=/100".parse().unwrap();
        assert_eq!(n.rate.unwrap().bytes_per_s, None);
        assert_eq!(n.name(), "--net tap=t");
    }

    #[test]
    fn net_specs_print_as_specs_that_parse_back() {
        for text in [
            "tap=tap0",
            "tap=t1,ip=10.0.0.1,mask=255.255.255.0,mac=52:54:00:12:34:56,queue_size=64,rate=1048576/100",
            "fd=7,rate=/20",
            "tap=t2,mac=52:54:00:12:34:56,num_queues=8,queue_size=64",
        ] {
            let n: NetConfig = text.parse().unwrap();
            assert_eq!(n.to_string(), text);
        }
        let n: NetConfig = "queue_size=256,rate=1M,tap=t".parse().unwrap();
        assert_eq!(n.to_string(), "tap=t,rate=1048576");
        let n: NetConfig = "num_queues=2,tap=t".parse().unwrap();
        assert_eq!(n.to_string(), "tap=t");
        let n: NetConfig = "num_queues=4,tap=t".parse().unwrap();
        assert_eq!(n.to_string(), "tap=t,num_queues=4");
        assert_eq!(n.queue_pairs(), 2);
        // fd= is one TAP queue: the default of one pair may still be spelt out.
        let n: NetConfig = "fd=9,num_queues=2".parse().unwrap();
        assert_eq!((n.num_queues, n.queue_pairs()), (2, 1));
        assert_eq!(n.to_string(), "fd=9");
        // Several handed-over queues: a pair each, the count implied.
        let n: NetConfig = "fd=9:10:11,mac=52:54:00:12:34:56".parse().unwrap();
        assert_eq!((n.num_queues, n.queue_pairs()), (6, 3));
        assert_eq!(n.to_string(), "fd=9:10:11,mac=52:54:00:12:34:56");
        assert_eq!(n.name(), "--net fd=9:10:11");
        let n: NetConfig = "fd=9:10,num_queues=4".parse().unwrap();
        assert_eq!(n.to_string(), "fd=9:10");
        let n: NetConfig = format!("tap=t,num_queues={MAX_NUM_QUEUES}")
            .parse()
            .unwrap();
        assert_eq!(
            n.queue_pairs(),
            usize::from(devices::virtio::net::MAX_QUEUE_PAIRS)
        );
        assert_eq!(n.to_string().parse::<NetConfig>().unwrap(), n);
    }

    #[test]
    fn malformed_net_specs_name_the_problem() {
        spec::assert_refusals::<NetConfig>(
            "--net",
            NET_SYNTAX,
            &[
                ("ip=10.0.0.1", "give tap=NAME or fd=N"),
                ("tap=a,fd=4", "give one"),
                ("tap=a/b", "no '/'"),
                ("tap=abcdefghijklmnop", "1 to 15 bytes"),
                ("fd=1", "standard input, output or error"),
                ("fd=x", "fd=\"x\""),
                ("tap=t,mask=255.0.0.0", "mask= without ip="),
                ("tap=t,ip=10.0.0", "ip=\"10.0.0\""),
                ("fd=5,ip=10.0.0.1", "orchestrator owns its addresses"),
                ("tap=t,mac=01:00:00:00:00:01", "multicast"),
                ("tap=t,mac=52:54:00:12:34", "six hexadecimal bytes"),
                ("tap=t,mac=52:54:00:12:34:zz", "\"zz\" is not hexadecimal"),
                ("tap=t,queue_size=100", "power of two from 2 to 256"),
                ("tap=t,queue_size=512", "power of two"),
                ("tap=t,rate=0", "zero would stop all traffic"),
                (
                    "tap=t,rate=/",
                    "bytes per second, packets per second, or both",
                ),
                ("tap=t,rate=1M/lots", "\"lots\" is not a whole number"),
                ("tap=t,speed=1", "unknown key \"speed\""),
                (
                    "tap=t,num_queues=3",
                    "num_queues=3 must be an even number from 2 to 32",
                ),
                ("tap=t,num_queues=1", "num_queues=1 must be an even number"),
                ("tap=t,num_queues=0", "num_queues=0 must be an even number"),
                (
                    "tap=t,num_queues=34",
                    "num_queues=34 must be an even number from 2 to 32",
                ),
                ("tap=t,num_queues=many", "num_queues=\"many\""),
                (
                    "fd=5,num_queues=4",
                    "num_queues=4 with fd=5: each handed-over descriptor is one TAP queue, so \
                     one queue pair (num_queues=2)",
                ),
                ("fd=5:6,num_queues=2", "num_queues=2 with fd=5:6"),
                ("fd=5:6:5", "fd=5:6:5: descriptor 5 is given twice"),
                ("fd=5:2", "fd=2 is standard input"),
                ("fd=5:", "\"\" is not a descriptor number"),
            ],
        );
    }

    #[test]
    fn two_devices_on_one_tap_are_refused() {
        let n = |t: &str| t.parse::<NetConfig>().unwrap();
        assert!(check_distinct(&[n("tap=a"), n("tap=b"), n("fd=5"), n("fd=6")]).is_ok());
        let e = check_distinct(&[n("tap=a"), n("fd=5"), n("tap=a")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--net tap=a is given twice"), "{e}");
        let e = check_distinct(&[n("fd=5"), n("fd=5")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--net fd=5 is given twice"), "{e}");
        // One queue in two devices' lists is the same TAP queue twice.
        let e = check_distinct(&[n("fd=5:6"), n("fd=7:6")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--net fd=7:6 is given twice"), "{e}");
    }

    #[test]
    fn json_net_entries_take_the_words_the_flag_takes() {
        let n: NetConfig =
            serde_json::from_str(r#"{"tap": "t0", "mac": "52:54:00:00:00:01", "rate": "1M"}"#)
                .unwrap();
        assert_eq!(n.mac, Some(MacAddr([0x52, 0x54, 0, 0, 0, 1])));
        assert_eq!(n.queue_size, DEFAULT_QUEUE_SIZE);
        assert_eq!(n.num_queues, DEFAULT_NUM_QUEUES);
        assert!(n.check().is_ok());
        let n: NetConfig = serde_json::from_str(r#"{"tap": "t0", "num_queues": 6}"#).unwrap();
        assert_eq!(n.queue_pairs(), 3);
        let n: NetConfig = serde_json::from_str(r#"{"fd": 5, "num_queues": 4}"#).unwrap();
        assert!(n
            .check()
            .unwrap_err()
            .to_string()
            .contains("num_queues=4 with fd=5"));
        // A list, a pair per descriptor; written back as it came.
        let n: NetConfig = serde_json::from_str(r#"{"fd": [5, 6], "num_queues": 4}"#).unwrap();
        assert!(n.check().is_ok());
        assert_eq!(n.fd, Some(Fds(vec![5, 6])));
        let back = serde_json::to_string(&n).unwrap();
        assert!(back.contains(r#""fd":[5,6]"#), "{back}");
        assert_eq!(serde_json::from_str::<NetConfig>(&back).unwrap(), n);
        let e = serde_json::from_str::<NetConfig>(r#"{"tap": "t0", "mac": "nope"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"nope\""), "{e}");
        // What a snapshot writes reads back the same.
        let full: NetConfig = "tap=t,ip=10.0.0.1,mac=52:54:00:00:00:02,rate=1M/20"
            .parse()
            .unwrap();
        let back: NetConfig = serde_json::from_str(&serde_json::to_string(&full).unwrap()).unwrap();
        assert_eq!(back, full);
        let only_packets: NetConfig = "tap=t,rate=/20".parse().unwrap();
        let text = serde_json::to_string(&only_packets).unwrap();
        assert!(text.contains("\"rate\":\"/20\""), "{text}");
        let n: NetConfig = serde_json::from_str(r#"{"ip": "10.0.0.1"}"#).unwrap();
        assert!(n
            .check()
            .unwrap_err()
            .to_string()
            .contains("tap=NAME or fd=N"));
    }
}
