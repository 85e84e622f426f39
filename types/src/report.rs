//! `musubi run --report`: how the VM ended, its exits by reason and its timings.

use crate::metrics::Coherence;
use serde::{Deserialize, Serialize};

/// Why the VM stopped, as reports write it: `{"kind": "guest_exit", "status": 3}`,
/// `{"kind": "guest_crash", "message": "..."}`, `{"kind": "signal", "signal": 15}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    /// The guest wrote `status` to the exit port.
    GuestExit {
        status: u8,
    },
    /// The guest reset or powered off the machine.
    Shutdown,
    GuestCrash {
        message: String,
    },
    VmmError {
        message: String,
    },
    Signal {
        signal: i32,
    },
    /// `Ctrl-A x` at the console.
    ConsoleQuit,
    /// Another node of a multi-node VM ended it with `status`.
    Peer {
        node: u16,
        status: i32,
    },
    /// A node of a multi-node VM was lost with the pages it owned.
    NodeLost {
        node: u16,
        pages: u64,
        message: String,
    },
    /// The VM moved to the process `to` names.
    Migrated {
        to: String,
    },
}

impl Outcome {
    /// The `kind` the report names the outcome by.
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::GuestExit { .. } => "guest_exit",
            Outcome::Shutdown => "shutdown",
            Outcome::GuestCrash { .. } => "guest_crash",
            Outcome::VmmError { .. } => "vmm_error",
            Outcome::Signal { .. } => "signal",
            Outcome::ConsoleQuit => "console_quit",
            Outcome::Peer { .. } => "peer",
            Outcome::NodeLost { .. } => "node_lost",
            Outcome::Migrated { .. } => "migrated",
        }
    }
}

/// One exit reason's figures, summed over vCPUs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitSummary {
    pub reason: String,
    pub count: u64,
    pub vmm_ns: u64,
}

/// The whole `--report` file. A node of a multi-node VM adds `node` and `coherence`; the
/// launcher's report is node 0's with every node's report in `nodes`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    pub outcome: Outcome,
    /// The exit status `musubi run` returned.
    pub exit_code: i32,
    /// Largest count first.
    pub exits: Vec<ExitSummary>,
    pub total_exits: u64,
    pub interrupts: u64,
    /// From the start of the build to the first KVM_RUN; `null` if no vCPU ran.
    pub to_first_run_ns: Option<u64>,
    /// CLOCK_MONOTONIC at the first KVM_RUN, comparable across processes.
    pub first_run_monotonic_ns: Option<u64>,
    pub wall_ns: u64,
    /// The node this report is of, in a multi-node VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u16>,
    /// A node's coherence counters: `Some(None)` is the `null` of a node whose coherence
    /// layer failed before it could count.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::present"
    )]
    pub coherence: Option<Option<Coherence>>,
    /// Every node's report, in the launcher's; `None` for a node whose file was unreadable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<Vec<Option<RunReport>>>,
}

impl RunReport {
    /// A node's coherence counters, if it had any.
    pub fn coherence(&self) -> Option<&Coherence> {
        self.coherence.as_ref().and_then(Option::as_ref)
    }
}

display_json!(RunReport, Outcome);
