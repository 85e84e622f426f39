//! How a running VM ends: the first reason recorded wins, and the waiting thread is woken.

use devices::{EndRequest, EndSink};
use serde::ser::SerializeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

/// Why the VM stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The guest wrote this status to the exit port. Reports name it `guest_exit`, as they
    /// always have, so their readers need not change.
    GuestStatus(u8),
    /// The guest reset or powered off the machine.
    Shutdown,
    /// The guest did something no CPU survives (a triple fault, an unemulatable instruction).
    GuestCrash(String),
    /// The VMM itself failed.
    VmmError(String),
    /// A signal asked the VMM to stop (SIGTERM, SIGINT).
    Signal(i32),
    /// The person at the console asked to quit (`Ctrl-A x`); like pulling the plug, but
    /// asked for, so it is no failure.
    ConsoleQuit,
    /// Another node of a multi-node VM ended the VM; `code` is the status it ended with, so
    /// every node reports the guest's status.
    Peer { node: u16, code: i32 },
    /// A node of a multi-node VM was lost: the pages it owned are gone, so no node may run on.
    NodeLost { node: u16, pages: u64, why: String },
    /// The VM moved to another process (`to` names it) and runs on there.
    Migrated { to: String },
}

/// The exit status of every surviving node when a node of its VM is lost.
pub const NODE_LOST_STATUS: i32 = 123;

impl Outcome {
    /// The process exit status `musubi run` returns for this outcome.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::GuestStatus(n) => *n as i32,
            Outcome::Shutdown => 0,
            Outcome::GuestCrash(_) => 125,
            Outcome::VmmError(_) => 126,
            Outcome::Signal(s) => 128 + s,
            Outcome::ConsoleQuit => 0,
            Outcome::Peer { code, .. } => *code,
            Outcome::NodeLost { .. } => NODE_LOST_STATUS,
            Outcome::Migrated { .. } => 0,
        }
    }

    /// A short name for reports.
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::GuestStatus(_) => "guest_exit",
            Outcome::Shutdown => "shutdown",
            Outcome::GuestCrash(_) => "guest_crash",
            Outcome::VmmError(_) => "vmm_error",
            Outcome::Signal(_) => "signal",
            Outcome::ConsoleQuit => "console_quit",
            Outcome::Peer { .. } => "peer",
            Outcome::NodeLost { .. } => "node_lost",
            Outcome::Migrated { .. } => "migrated",
        }
    }
}

/// `{"kind": "guest_exit", "status": 3}`, `{"kind": "guest_crash", "message": "..."}`,
/// `{"kind": "signal", "signal": 15}`: what a report reader can match on.
impl serde::Serialize for Outcome {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("kind", self.kind())?;
        match self {
            Outcome::GuestStatus(n) => m.serialize_entry("status", n)?,
            Outcome::GuestCrash(msg) | Outcome::VmmError(msg) => {
                m.serialize_entry("message", msg)?
            }
            Outcome::Signal(sig) => m.serialize_entry("signal", sig)?,
            Outcome::Shutdown | Outcome::ConsoleQuit => {}
            Outcome::Peer { node, code } => {
                m.serialize_entry("node", node)?;
                m.serialize_entry("status", code)?;
            }
            Outcome::NodeLost { node, pages, why } => {
                m.serialize_entry("node", node)?;
                m.serialize_entry("pages", pages)?;
                m.serialize_entry("message", why)?;
            }
            Outcome::Migrated { to } => m.serialize_entry("to", to)?,
        }
        m.end()
    }
}

/// The text a panic was raised with, for the outcome of a VMM thread that panicked.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

/// Where a VM's outcome is decided, shared by every thread of the VM and by whoever embeds
/// it: the first [`RunControl::finish`] wins, so a guest exit, a crash, a signal and a peer's
/// stop racing each other end the VM once, and vCPUs check [`RunControl::is_finished`] after
/// every exit without taking a lock.
#[derive(Default)]
pub struct RunControl {
    outcome: Mutex<Option<Outcome>>,
    changed: Condvar,
    /// Mirrors `outcome.is_some()`, so vCPUs can check it after every exit without a lock.
    finished: AtomicBool,
}

impl RunControl {
    /// Records `o` unless an earlier outcome is already set.
    pub fn finish(&self, o: Outcome) {
        let mut g = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(o);
            self.finished.store(true, Ordering::Release);
            self.changed.notify_all();
        }
    }

    /// The outcome, once the VM has one.
    pub fn outcome(&self) -> Option<Outcome> {
        self.outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether the VM has an outcome (and its threads should stop).
    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Blocks until an outcome is recorded, checking `poll` every `tick` (for signals).
    pub fn wait(
        &self,
        tick: std::time::Duration,
        mut poll: impl FnMut() -> Option<Outcome>,
    ) -> Outcome {
        let mut g = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(o) = g.clone() {
                return o;
            }
            if let Some(o) = poll() {
                *g = Some(o.clone());
                self.finished.store(true, Ordering::Release);
                return o;
            }
            g = self
                .changed
                .wait_timeout(g, tick)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl EndSink for RunControl {
    fn request_end(&self, request: EndRequest) {
        self.finish(match request {
            EndRequest::Status(n) => Outcome::GuestStatus(n),
            EndRequest::Reset | EndRequest::PowerOff => Outcome::Shutdown,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn first_outcome_wins() {
        let c = RunControl::default();
        c.request_end(EndRequest::Status(7));
        c.finish(Outcome::Shutdown);
        assert_eq!(
            c.wait(Duration::from_millis(1), || None),
            Outcome::GuestStatus(7)
        );
        assert_eq!(Outcome::GuestStatus(7).exit_code(), 7);
    }

    #[test]
    fn poll_can_end_the_wait() {
        let c = RunControl::default();
        let o = c.wait(Duration::from_millis(1), || Some(Outcome::Signal(15)));
        assert_eq!(o.exit_code(), 143);
        assert!(c.is_finished());
    }

    #[test]
    fn outcomes_serialize_as_kind_and_detail() {
        let j = |o: Outcome| serde_json::to_value(o).unwrap();
        assert_eq!(
            j(Outcome::GuestStatus(3)),
            serde_json::json!({"kind": "guest_exit", "status": 3})
        );
        assert_eq!(
            j(Outcome::Shutdown),
            serde_json::json!({"kind": "shutdown"})
        );
        assert_eq!(
            j(Outcome::GuestCrash("triple fault".into())),
            serde_json::json!({"kind": "guest_crash", "message": "triple fault"})
        );
        assert_eq!(
            j(Outcome::Signal(15)),
            serde_json::json!({"kind": "signal", "signal": 15})
        );
        assert_eq!(
            j(Outcome::ConsoleQuit),
            serde_json::json!({"kind": "console_quit"})
        );
        assert_eq!(Outcome::ConsoleQuit.exit_code(), 0);
    }
}
