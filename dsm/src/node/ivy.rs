//! The baseline: Li & Hudak's Ivy, improved centralized manager. The manager only knows the
//! owner and forwards requests to it; the owner keeps the copyset, serves requests one at a
//! time, and before giving the page to a writer invalidates every copy and waits for all
//! acknowledgements (the synchronous invalidation the paper compares against). Read faults
//! send no confirmation.
//!
//! Ordering relies on each pair of nodes delivering in order (TCP): an owner's read reply and
//! its later invalidation reach the reader in that order, and the manager's forwards reach an
//! owner in the order the manager chose.

use super::{unexpected, Node, Pending};
use crate::event::{Action, PageOp};
use crate::types::{Access, NodeId, NodeSet, PageNo, Prot};
use crate::wire::Message;

type R = Result<(), super::ProtocolError>;

pub(super) fn on_message(n: &mut Node, from: NodeId, msg: Message, out: &mut Vec<Action>) -> R {
    let me = n.id;
    match msg {
        Message::Req {
            page,
            access,
            requester,
        } => {
            if n.manager(page) != me {
                return Err(unexpected(from, &msg, "this node does not manage the page"));
            }
            if requester != from {
                return Err(unexpected(from, &msg, "requester is not the sender"));
            }
            let m = n.managed(page);
            let owner = m.owner;
            if access == Access::Write {
                m.owner = requester;
            }
            let fwd = Message::Fwd {
                page,
                access,
                requester,
            };
            n.send(owner, fwd, out);
            Ok(())
        }
        Message::Fwd {
            page,
            access,
            requester,
        } => {
            if from != n.manager(page) {
                return Err(unexpected(from, &msg, "sender does not manage the page"));
            }
            let c = n.copy(page);
            if !(c.master || c.fetch == Some(Access::Write)) {
                return Err(unexpected(
                    from,
                    &msg,
                    "this node neither owns nor awaits ownership of the page",
                ));
            }
            if c.queue.iter().any(|q| q.0 == requester) {
                return Err(unexpected(from, &msg, "this requester is already queued"));
            }
            c.queue.push_back((requester, access));
            serve(n, page, out);
            Ok(())
        }
        Message::Inval { page } => {
            let c = n.copy(page);
            if c.master {
                return Err(unexpected(from, &msg, "the owner is never invalidated"));
            }
            if c.prot != Prot::ReadOnly {
                return Err(unexpected(from, &msg, "this node holds no read copy"));
            }
            n.set_prot(page, Prot::None, out);
            n.send(from, Message::InvalAck { page }, out);
            Ok(())
        }
        Message::InvalAck { page } => {
            let c = n.copy(page);
            let Some((requester, mut waiting)) = c.invalidating else {
                return Err(unexpected(from, &msg, "no invalidation is in progress"));
            };
            if !waiting.contains(from) {
                return Err(unexpected(from, &msg, "the sender was not invalidated"));
            }
            waiting.remove(from);
            if !waiting.is_empty() {
                c.invalidating = Some((requester, waiting));
                return Ok(());
            }
            c.invalidating = None;
            hand_over(n, page, requester, out);
            serve(n, page, out);
            Ok(())
        }
        Message::PageData { page, access, .. } => {
            let c = n.copy(page);
            if c.fetch != Some(access) {
                return Err(unexpected(from, &msg, "no request of this access is out"));
            }
            if c.master {
                return Err(unexpected(from, &msg, "this node already owns the page"));
            }
            c.pending = Pending::Installing(access);
            let Message::PageData { data, .. } = msg else {
                unreachable!("matched above")
            };
            out.push(Action::Page {
                page,
                op: PageOp::Install {
                    data,
                    writable: access == Access::Write,
                },
            });
            Ok(())
        }
        _ => Err(unexpected(from, &msg, "not a message of this protocol")),
    }
}

/// Serves queued requests at the owner until one needs to wait (a send to complete, or
/// invalidations to be acknowledged) or ownership moves away.
pub(super) fn serve(n: &mut Node, page: PageNo, out: &mut Vec<Action>) {
    let me = n.id;
    loop {
        let held = n.held(page);
        let c = n.copy(page);
        if !c.master || c.invalidating.is_some() || c.pending != Pending::None {
            return;
        }
        if held && c.queue.iter().any(|q| q.0 != me) {
            // Served when the hold is over (`Node::hold_over`).
            n.hold_timer(page, out);
            return;
        }
        let Some((r, a)) = c.queue.pop_front() else {
            return;
        };
        match a {
            Access::Read if r == me => n.grant_local(page, a, out),
            Access::Read => {
                n.set_prot(page, Prot::ReadOnly, out);
                let c = n.copy(page);
                c.copyset.insert(r);
                c.pending = Pending::Sending { drop_after: false };
                out.push(Action::SendPage {
                    to: r,
                    page,
                    access: a,
                });
            }
            Access::Write => {
                let mut targets = c.copyset;
                targets.remove(r);
                targets.remove(me);
                if targets.is_empty() {
                    hand_over(n, page, r, out);
                } else {
                    c.invalidating = Some((r, targets));
                    for t in targets.iter() {
                        n.send(t, Message::Inval { page }, out);
                    }
                }
            }
        }
    }
}

/// Every other copy is gone: give the page to the writer.
fn hand_over(n: &mut Node, page: PageNo, r: NodeId, out: &mut Vec<Action>) {
    n.copy(page).copyset = NodeSet::EMPTY;
    if r == n.id {
        n.grant_local(page, Access::Write, out);
        return;
    }
    // Hide before the bytes leave, so no local write can follow the copy that is sent.
    n.set_prot(page, Prot::None, out);
    let c = n.copy(page);
    c.master = false;
    c.pending = Pending::Sending { drop_after: true };
    out.push(Action::SendPage {
        to: r,
        page,
        access: Access::Write,
    });
}
