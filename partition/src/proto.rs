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
        let e = Reply::Error {
            message: "no".into(),
        };
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"reply":"error","message":"no"}"#
        );
    }
}
