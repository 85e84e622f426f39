//! `--vsock cid=N,socket=PATH`: the guest's vsock context id and the UNIX socket its host
//! side listens on (Firecracker's and Cloud Hypervisor's hybrid scheme).

use super::spec::Spec;
use super::ConfigError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

pub const VSOCK_SYNTAX: &str = "cid=N,socket=PATH";
/// 0 and 1 are reserved, 2 is the host; u32::MAX is VMADDR_CID_ANY in a guest's sockaddr_vm.
pub const MIN_CID: u64 = 3;
pub const MAX_CID: u64 = u32::MAX as u64 - 1;

/// The guest's vsock device. Plain data so any front end (the flag, a JSON file, Cloud
/// Hypervisor's VmConfig) can build one; [`VsockConfig::check`] says what a VM accepts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    pub cid: u64,
    /// Host programs connect here; a guest connecting to host port P reaches `SOCKET_P`.
    pub socket: PathBuf,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VsockConfigError {
    #[error("cid {0} is reserved: a guest's cid is {MIN_CID} to {MAX_CID}")]
    Cid(u64),
    #[error("socket= is empty")]
    EmptySocket,
    #[error("socket {0} already exists: remove it or pick another path")]
    SocketExists(String),
}

impl VsockConfig {
    /// The refusals that need no spec text: what every front end must obey.
    pub fn check(&self) -> Result<(), VsockConfigError> {
        if !(MIN_CID..=MAX_CID).contains(&self.cid) {
            return Err(VsockConfigError::Cid(self.cid));
        }
        if self.socket.as_os_str().is_empty() {
            return Err(VsockConfigError::EmptySocket);
        }
        Ok(())
    }

    /// Refuses a path that is already taken, before anything of the VM is built.
    pub fn check_free(&self) -> Result<(), VsockConfigError> {
        if std::fs::symlink_metadata(&self.socket).is_ok() {
            return Err(VsockConfigError::SocketExists(
                self.socket.display().to_string(),
            ));
        }
        Ok(())
    }
}

impl FromStr for VsockConfig {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        let spec = Spec::parse("--vsock", VSOCK_SYNTAX, text, &["cid", "socket"])?;
        let c = VsockConfig {
            cid: spec
                .value("cid")?
                .ok_or_else(|| spec.error("cid= is missing"))?,
            socket: spec.path("socket")?,
        };
        c.check().map_err(|why| spec.error(why.to_string()))?;
        Ok(c)
    }
}

/// The flag's own form, so a command line made from a parsed `--vsock` parses back.
impl fmt::Display for VsockConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cid={},socket={}", self.cid, self.socket.display())
    }
}

/// Parses a `--vsock` given as a JSON string (the flag's form) as well as an object.
pub fn from_flag_or_object<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<VsockConfig>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Form {
        Flag(String),
        Object(VsockConfig),
    }
    match Option::<Form>::deserialize(d)? {
        None => Ok(None),
        Some(Form::Flag(s)) => s.parse().map(Some).map_err(serde::de::Error::custom),
        Some(Form::Object(c)) => {
            c.check().map_err(serde::de::Error::custom)?;
            Ok(Some(c))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_back() {
        let c: VsockConfig = "cid=3,socket=/tmp/v.sock".parse().unwrap();
        assert_eq!(
            c,
            VsockConfig {
                cid: 3,
                socket: "/tmp/v.sock".into()
            }
        );
        assert_eq!(c.to_string().parse::<VsockConfig>().unwrap(), c);
    }

    #[test]
    fn refusals_name_the_flag_and_the_value() {
        for (text, why) in [
            ("cid=2,socket=/tmp/v", "cid 2 is reserved"),
            ("cid=0,socket=/tmp/v", "cid 0 is reserved"),
            ("cid=4294967295,socket=/tmp/v", "reserved"),
            ("cid=x,socket=/tmp/v", "cid=\"x\""),
            ("socket=/tmp/v", "cid= is missing"),
            ("cid=3", "socket= is missing"),
            ("cid=3,socket=", "socket is empty"),
            ("cid=3,socket=/tmp/v,port=1", "unknown key"),
            ("cid=3,cid=4,socket=/tmp/v", "given twice"),
        ] {
            let e = text.parse::<VsockConfig>().unwrap_err().to_string();
            assert!(e.contains("--vsock") && e.contains(text), "{e}");
            assert!(e.contains(why), "{text}: {e}");
        }
    }
}
