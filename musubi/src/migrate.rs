//! Live migration between `musubi run` processes (post-copy, or pre-copy on request): the
//! flags that ask for it. The migration itself is `musubi_migration::vm`'s:
//! - destination: `run --receive-migration tcp:HOST:PORT --secret-file F` waits for one VM
//!   ([`receive`]) and builds it on guest RAM whose pages come from the source;
//! - standby: `run --standby-for tcp:HOST:PORT --secret-file F` waits for a primary
//!   (`run --replicate-to`) and runs its VM from the last whole epoch once it is lost
//!   ([`stand_by`]);
//! - source: a migrator thread (`musubi_migration::vm::Migrator`), started before the
//!   system-call filters go on, connects and moves the VM when the API asks (`PUT
//!   vm.send-migration`); the API thread only hands it the request and waits for the answer.

use crate::cli;
use musubi_migration::vm::{Received, Receiving, SendRequest, StandbyEnd};
use musubi_migration::Mode;
use signal_hook::iterator::Signals;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// A `tcp:HOST:PORT` migration URL (`run --receive-migration`, `remote send-migration`),
/// checked when the command line is read and kept as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationUrl(String);

impl MigrationUrl {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for MigrationUrl {
    type Err = musubi_migration::UrlError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        musubi_migration::parse_url(text).map(|_| MigrationUrl(text.to_string()))
    }
}

impl fmt::Display for MigrationUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Something another partition owns, as `PARTITION:WHAT` (`--foreign-storage
/// PARTITION:PATH`, `--foreign-tap PARTITION:NAME`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owned {
    pub partition: String,
    pub what: String,
}

impl Owned {
    /// `text`, given to `flag`, whose form is `syntax`.
    pub fn parse(flag: &str, syntax: &str, text: &str) -> Result<Owned, String> {
        match text.split_once(':') {
            Some((partition, what)) => Ok(Owned {
                partition: partition.to_string(),
                what: what.to_string(),
            }),
            None => Err(format!("{flag} {text:?}: expected {syntax}")),
        }
    }
}

impl fmt::Display for Owned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.partition, self.what)
    }
}

/// Why no VM came: the message, and the exit status.
pub struct NotReceived {
    pub message: String,
    pub code: u8,
}

/// What other partitions own, as their supervisor tells a VM that waits for a migration
/// (`--foreign-storage PARTITION:PATH`, `--foreign-tap PARTITION:NAME`).
pub struct Foreign<'a> {
    pub storage: &'a [Owned],
    pub taps: &'a [Owned],
}

/// `run --receive-migration URL`: waits for one VM and builds it. A signal (SIGTERM,
/// SIGINT, SIGHUP) ends the wait with status 128+N.
pub fn receive(
    url: &MigrationUrl,
    secret_file: &Path,
    foreign: Foreign<'_>,
    vm: &cli::VmArgs,
    opts: vmm::RunOptions,
    signals: &mut Signals,
) -> Result<Received, NotReceived> {
    waiting(
        "--receive-migration",
        url,
        secret_file,
        foreign,
        vm,
        opts,
        signals,
        "a migration",
        musubi_migration::vm::receive,
    )
}

/// `run --standby-for URL`: waits as a primary's standby until the primary is lost (the VM,
/// holding its last whole epoch, is returned to run) or its VM ends. A signal ends the wait
/// as for [`receive`].
pub fn stand_by(
    url: &MigrationUrl,
    secret_file: &Path,
    heartbeat: std::time::Duration,
    vm: &cli::VmArgs,
    opts: vmm::RunOptions,
    signals: &mut Signals,
) -> Result<StandbyEnd, NotReceived> {
    let none = Foreign {
        storage: &[],
        taps: &[],
    };
    waiting(
        "--standby-for",
        url,
        secret_file,
        none,
        vm,
        opts,
        signals,
        "a primary",
        |r, stop, log| musubi_migration::vm::stand_by(r, heartbeat, stop, log),
    )
}

/// Waits on `url` (given to `flag`) for `what` with `wait`, a signal ending the wait.
#[allow(clippy::too_many_arguments)]
fn waiting<T>(
    flag: &'static str,
    url: &MigrationUrl,
    secret_file: &Path,
    foreign: Foreign<'_>,
    vm: &cli::VmArgs,
    opts: vmm::RunOptions,
    signals: &mut Signals,
    what: &str,
    wait: impl FnOnce(
        Receiving<'_>,
        &mut dyn FnMut() -> Option<String>,
        &mut dyn FnMut(&str),
    ) -> Result<T, musubi_migration::vm::NotReceived>,
) -> Result<T, NotReceived> {
    let given = vm
        .given_devices()
        .map_err(|message| NotReceived { message, code: 1 })?;
    let mut signal = None;
    let mut stop = || {
        for s in signals.pending() {
            if s != signal_hook::consts::SIGUSR1 {
                signal = Some(s);
                return Some(format!("stopped by signal {s} while waiting for {what}"));
            }
        }
        None
    };
    let mut log = |m: &str| eprintln!("musubi: {m}");
    // The migration crate takes them as written.
    let written = |list: &[Owned]| list.iter().map(Owned::to_string).collect::<Vec<_>>();
    let (foreign_storage, foreign_taps) = (written(foreign.storage), written(foreign.taps));
    let r = wait(
        Receiving {
            flag,
            url: url.as_str(),
            secret_file,
            given,
            foreign_storage: &foreign_storage,
            foreign_taps: &foreign_taps,
            opts,
        },
        &mut stop,
        &mut log,
    );
    r.map_err(|e| NotReceived {
        message: e.to_string(),
        code: signal.map_or(1, |s| 128 + s as u8),
    })
}

/// What `PUT vm.send-migration` asks for, as the migrator takes it; `default_secret` is the
/// VMM's `--secret-file`, for a body that names none.
pub fn send_request(
    req: &musubi_api::SendMigration,
    default_secret: Option<&Path>,
) -> Result<SendRequest, musubi_api::ActionError> {
    Ok(SendRequest {
        url: req.url.clone(),
        secret_file: secret(req.secret_file.as_deref(), default_secret)?,
        push_limit: req.push_limit,
        mode: match req.precopy {
            Some(p) => Mode::PreCopy {
                downtime: std::time::Duration::from_millis(p.downtime_ms),
                max_rounds: p.max_rounds,
            },
            None => Mode::PostCopy,
        },
    })
}

/// The secret file a migration through the API uses: the one its body names, else the
/// VMM's own `--secret-file`.
pub fn secret(
    given: Option<&Path>,
    default_secret: Option<&Path>,
) -> Result<PathBuf, musubi_api::ActionError> {
    given
        .or(default_secret)
        .map(Path::to_path_buf)
        .ok_or_else(|| {
            musubi_api::ActionError::bad_request(
                "no secret file: name one in the body (\"secret_file\", or under \"musubi\"), \
             or start the VMM with --secret-file FILE",
            )
        })
}
