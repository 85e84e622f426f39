//! The paper's protocol (Kaneda, Oyama, Yonezawa 2005, Fig. 5), one handler per guarded
//! action. The manager serialises the requests for a page with its busy flag; invalidations
//! are fire-and-forget, and only the owner answers, with the page. Under [`Ordering::Tso`]
//! (the default) the read copies answer a write invalidation with `inval-ack` to the manager,
//! which tells the owner to hand over only when all have answered (see [`Ordering`]).

use super::{unexpected, Managed, Node, Ordering, Pending};
use crate::event::Action;
use crate::types::{Access, NodeId, NodeSet, PageNo, Prot};
use crate::wire::Message;

type R = Result<(), super::ProtocolError>;

/// A fetch or finish must reach the page's manager from the node it names as requester;
/// the manager's record of the page, once it has.
fn managed_request<'a>(
    n: &'a mut Node,
    from: NodeId,
    msg: &Message,
    page: PageNo,
    requester: NodeId,
) -> Result<&'a mut Managed, super::ProtocolError> {
    if n.manager(page) != n.id {
        return Err(unexpected(from, msg, "this node does not manage the page"));
    }
    if requester != from {
        return Err(unexpected(from, msg, "requester is not the sender"));
    }
    Ok(n.managed(page))
}

pub(super) fn on_message(n: &mut Node, from: NodeId, msg: Message, out: &mut Vec<Action>) -> R {
    match msg {
        Message::Fetch {
            page,
            access,
            requester,
        } => {
            let m = managed_request(n, from, &msg, page, requester)?;
            if m.queue.iter().any(|q| q.0 == requester) {
                return Err(unexpected(
                    from,
                    &msg,
                    "the sender already has a fetch queued",
                ));
            }
            if m.busy.is_some() {
                m.queue.push_back((requester, access));
                return Ok(());
            }
            serve(n, page, requester, access, out);
            Ok(())
        }
        Message::Inv {
            page,
            access,
            requester,
            owner,
        } => inv(n, from, &msg, page, access, requester, owner, out),
        Message::PageData { page, access, .. } => {
            let c = n.copy(page);
            if c.fetch != Some(access) {
                return Err(unexpected(from, &msg, "no fetch of this access is out"));
            }
            if c.master {
                return Err(unexpected(
                    from,
                    &msg,
                    "this node holds the page; its own copy is current",
                ));
            }
            c.pending = Pending::Installing(access);
            let Message::PageData { data, .. } = msg else {
                unreachable!("matched above")
            };
            out.push(Action::Page {
                page,
                op: crate::event::PageOp::Install {
                    data,
                    writable: access == Access::Write,
                },
            });
            Ok(())
        }
        Message::Finish {
            page,
            access,
            requester,
        } => {
            let m = managed_request(n, from, &msg, page, requester)?;
            if m.busy != Some((requester, access)) {
                return Err(unexpected(
                    from,
                    &msg,
                    "the manager is not serving this fetch",
                ));
            }
            match access {
                Access::Read => m.copyset.insert(requester),
                Access::Write => {
                    m.copyset = NodeSet::single(requester);
                    m.owner = requester;
                }
            }
            m.busy = None;
            if let Some((next, a)) = m.queue.pop_front() {
                serve(n, page, next, a, out);
            }
            Ok(())
        }
        Message::InvalAck { page } => {
            if n.manager(page) != n.id {
                return Err(unexpected(from, &msg, "this node does not manage the page"));
            }
            let m = n.managed(page);
            let Some((s, Access::Write)) = m.busy else {
                return Err(unexpected(from, &msg, "the manager is not serving a write"));
            };
            if !m.acks.contains(from) {
                return Err(unexpected(from, &msg, "the sender owes no acknowledgement"));
            }
            m.acks.remove(from);
            if m.acks.is_empty() {
                let own = m.owner;
                send_inv(n, own, page, Access::Write, s, own, out);
            }
            Ok(())
        }
        _ => Err(unexpected(from, &msg, "not a message of this protocol")),
    }
}

/// Paper: `receive ⟨fetch, n, a, s⟩ when p.busy = false`.
fn serve(n: &mut Node, page: PageNo, s: NodeId, a: Access, out: &mut Vec<Action>) {
    let m: &mut Managed = n.managed(page);
    m.busy = Some((s, a));
    let own = m.owner;
    let targets = match a {
        Access::Read => NodeSet::single(own),
        // S(p, s) = { x ∈ p.copyset : x ≠ s ∨ x = p.own }
        Access::Write => {
            let mut t = m.copyset;
            if s != own {
                t.remove(s);
            }
            t.insert(own);
            t
        }
    };
    if n.ordering == Ordering::Tso && a == Access::Write {
        // The copies first; the owner, which moves the page, once they have all acknowledged.
        let mut copies = targets;
        copies.remove(own);
        if !copies.is_empty() {
            n.managed(page).acks = copies;
            for x in copies.iter() {
                send_inv(n, x, page, a, s, own, out);
            }
            return;
        }
    }
    for x in targets.iter() {
        send_inv(n, x, page, a, s, own, out);
    }
}

/// Paper: `send ⟨inv, n, a, s, o⟩ to` one target; the serving round and, under TSO, the
/// last acknowledgement both send it.
fn send_inv(
    n: &mut Node,
    to: NodeId,
    page: PageNo,
    access: Access,
    requester: NodeId,
    owner: NodeId,
    out: &mut Vec<Action>,
) {
    let inv = Message::Inv {
        page,
        access,
        requester,
        owner,
    };
    n.send(to, inv, out);
}

/// Paper: `receive ⟨inv, n, a, s, o⟩`.
#[allow(clippy::too_many_arguments)]
fn inv(
    n: &mut Node,
    from: NodeId,
    msg: &Message,
    page: PageNo,
    a: Access,
    s: NodeId,
    o: NodeId,
    out: &mut Vec<Action>,
) -> R {
    if from != n.manager(page) {
        return Err(unexpected(from, msg, "sender does not manage the page"));
    }
    let me = n.id;
    let c = n.copy(page);
    if o == me && !c.master {
        return Err(unexpected(
            from,
            msg,
            "names this node owner, but it does not hold the page",
        ));
    }
    if a == Access::Read && o != me {
        return Err(unexpected(
            from,
            msg,
            "read invalidations go to the owner only",
        ));
    }
    if s == me && o != me {
        return Err(unexpected(
            from,
            msg,
            "invalidations skip their own requester unless it is the owner",
        ));
    }
    if o == me && s == me && c.fetch != Some(a) {
        return Err(unexpected(
            from,
            msg,
            "asks this node to answer itself, but it has no such fetch out",
        ));
    }
    if o == me && s == me {
        // The owner asked for its own page: the ack is local and no data moves.
        n.grant_local(page, a, out);
        return Ok(());
    }
    match a {
        Access::Read => {
            n.set_prot(page, Prot::ReadOnly, out);
            out.push(Action::SendPage {
                to: s,
                page,
                access: a,
            });
            n.copy(page).pending = Pending::Sending { drop_after: false };
        }
        Access::Write if o == me => {
            // Hide before the bytes leave, so no local write can follow the copy that is sent.
            n.set_prot(page, Prot::None, out);
            out.push(Action::SendPage {
                to: s,
                page,
                access: a,
            });
            let c = n.copy(page);
            c.master = false;
            c.pending = Pending::Sending { drop_after: true };
        }
        Access::Write => {
            // A copy holder, or an owner reached by an invalidation from an earlier round:
            // `set_prot` hides rather than drops when this node holds the only current copy.
            n.set_prot(page, Prot::None, out);
            if n.ordering == Ordering::Tso {
                // The copy is gone: the manager may now let the writer have the page.
                n.send(from, Message::InvalAck { page }, out);
            }
        }
    }
    Ok(())
}
