//! What the tests of several crates share: running a program under test with its time
//! bounded and always reaped (`process`), waiting for what it prints or opens (`wait`), the
//! probe guest's result lines (`probe`), stand-ins for the programs it runs (`fake`),
//! network namespaces of a test's own (`netns`) and a replicated VM's three of them
//! (`replica_net`), the kernel's table of TCP sockets
//! (`tcp`), slow-loris clients of a UNIX socket (`slow`) and a host program's side of a
//! VM's hybrid vsock (`vsock`).

mod ethtool;
mod fake;
pub mod netns;
mod probe;
mod process;
pub mod replica_net;
mod slow;
pub mod tcp;
pub mod vsock;
mod wait;

pub use fake::{fake_vmm, shell_script};
pub use probe::{result_in, results_in};
pub use process::{assert_kvm, run_command, start_command, wait_with_limit, Run, Started};
pub use slow::{assert_served_past_slow_clients, SlowClients};
pub use wait::{read_text, wait_until};
