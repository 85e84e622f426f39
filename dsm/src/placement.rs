//! Which node manages a page, and which node holds it before anyone has asked for it.
//!
//! The paper fixes `manager(n) = proc_{n mod N}`; a host may prefer another spread (for example
//! giving the I/O server fewer pages), so the rule is a trait.

use crate::types::{NodeId, PageNo};
use std::fmt::Debug;

pub trait Placement: Debug + Send + Sync {
    /// Every node must compute the same answer for a page, forever.
    fn manager(&self, page: PageNo) -> NodeId;

    /// The node whose memory holds the page at start, writable. Defaults to the manager, so a
    /// first touch on the manager's own node needs no message.
    fn initial_owner(&self, page: PageNo) -> NodeId {
        self.manager(page)
    }
}

/// The paper's rule: page `n` is managed by node `n mod N`.
#[derive(Clone, Copy, Debug)]
pub struct Modulo {
    pub nodes: u16,
}

impl Placement for Modulo {
    fn manager(&self, page: PageNo) -> NodeId {
        NodeId((page % u64::from(self.nodes.max(1))) as u16)
    }
}

/// Manager and initial owner given per page, for setting up a particular role combination
/// (tests, Table 3); pages not listed fall back to `page mod N`.
#[derive(Clone, Debug)]
pub struct Fixed {
    pub nodes: u16,
    /// `(page, manager, initial owner)`.
    pub pages: Vec<(PageNo, NodeId, NodeId)>,
}

impl Placement for Fixed {
    fn manager(&self, page: PageNo) -> NodeId {
        self.pages
            .iter()
            .find(|p| p.0 == page)
            .map(|p| p.1)
            .unwrap_or_else(|| Modulo { nodes: self.nodes }.manager(page))
    }
    fn initial_owner(&self, page: PageNo) -> NodeId {
        self.pages
            .iter()
            .find(|p| p.0 == page)
            .map(|p| p.2)
            .unwrap_or_else(|| self.manager(page))
    }
}
