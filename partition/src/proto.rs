//! The supervisor's socket protocol: one JSON object per line each way, one request and
//! one reply per connection. Plain enough to drive with `socat` by hand:
//! `echo '{"op":"list"}' | socat - UNIX-CONNECT:STATE/NAME/supervisor.sock`.

use crate::store::VmRecord;
use crate::Error;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    /// Start a VM: `musubi run ARGS`, in directory `cwd` (the CLI's, so relative paths
    /// in the arguments mean what the person meant).
    Run {
        args: Vec<String>,
        #[serde(default)]
        cwd: Option<PathBuf>,
    },
    /// Stop VM `vm` (SIGTERM, so its disks are flushed; SIGKILL if it lingers).
    Stop {
        vm: u32,
    },
    /// Pause VM `vm` through its control API (`PUT /api/v1/vm.pause`).
    Pause {
        vm: u32,
    },
    /// Resume VM `vm` through its control API (`PUT /api/v1/vm.resume`).
    Resume {
        vm: u32,
    },
    /// Snapshot VM `vm` into the absolute directory `dir` through its control API
    /// (`PUT /api/v1/vm.snapshot`): the VM is paused for it and stays paused.
    Snapshot {
        vm: u32,
        dir: PathBuf,
    },
    List,
    Status,
    /// Stop every VM, then the supervisor.
    Shutdown,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub partition: String,
    pub pid: u32,
    /// Whether the supervisor found itself in its partition's cgroup.
    pub in_cgroup: bool,
    pub vms_running: usize,
    /// Seconds since the Unix epoch.
    pub started: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "reply", rename_all = "lowercase")]
pub enum Reply {
    Vm { vm: VmRecord },
    Vms { vms: Vec<VmRecord> },
    Status { status: Status },
    Error { message: String },
}

/// How long the CLI waits for a supervisor's answer. `stop` and `shutdown` wait for VMs to
/// end, which may take the VMs' own grace period.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the supervisor waits for a VM's control API to pause or resume it.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the supervisor waits for a VM's control API to write a snapshot: the VM's
/// whole RAM goes to a file, seconds for a big VM.
pub const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the CLI waits for the supervisor's answer to a snapshot: the VM's time and
/// the supervisor's own.
pub const SNAPSHOT_REPLY_TIMEOUT: Duration =
    Duration::from_secs(SNAPSHOT_TIMEOUT.as_secs() + 2 * CONTROL_TIMEOUT.as_secs());

/// Sends one request and reads the reply.
pub fn call(socket: &Path, req: &Request, timeout: Duration) -> Result<Reply, Error> {
    let unreachable =
        |e: std::io::Error| Error::system(format!("supervisor socket {}: {e}", socket.display()));
    let mut stream = UnixStream::connect(socket).map_err(unreachable)?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(unreachable)?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(unreachable)?;
    let mut line = serde_json::to_string(req).map_err(|e| Error::system(e.to_string()))?;
    line.push('\n');
    stream.write_all(line.as_bytes()).map_err(unreachable)?;
    let mut answer = String::new();
    BufReader::new(stream)
        .read_line(&mut answer)
        .map_err(unreachable)?;
    if answer.is_empty() {
        return Err(Error::system(format!(
            "supervisor socket {}: closed without a reply",
            socket.display()
        )));
    }
    serde_json::from_str(&answer).map_err(|e| {
        Error::system(format!(
            "supervisor socket {}: bad reply {answer:?}: {e}",
            socket.display()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_form_is_tagged_json() {
        let r = Request::Run {
            args: vec!["--kernel".into(), "probe".into()],
            cwd: None,
        };
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(
            text,
            r#"{"op":"run","args":["--kernel","probe"],"cwd":null}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), r);
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"stop","vm":3}"#).unwrap(),
            Request::Stop { vm: 3 }
        );
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"pause","vm":2}"#).unwrap(),
            Request::Pause { vm: 2 }
        );
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"resume","vm":2}"#).unwrap(),
            Request::Resume { vm: 2 }
        );
        let s = Request::Snapshot {
            vm: 2,
            dir: "/srv/snap".into(),
        };
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(text, r#"{"op":"snapshot","vm":2,"dir":"/srv/snap"}"#);
        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), s);
        let e = Reply::Error {
            message: "no".into(),
        };
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"reply":"error","message":"no"}"#
        );
    }
}
