//! The dsm page operations carried out on a [`Memory`]: what each `PageOp` means in
//! userfaultfd terms, and where a page's bytes are when the protocol asks for them.

use crate::memory::{Memory, MemoryError};
use dsm::{NodeId, PageData, PageNo, PageOp, Placement, Prot, PAGE_SIZE};
use std::collections::HashMap;
use std::sync::Arc;

/// Where the local contents of a page are.
#[derive(Debug, Default)]
enum Bytes {
    /// Not mapped. If the node holds the page, its contents are all zero (never touched).
    #[default]
    Absent,
    /// Mapped; loads on it never fault.
    Present,
    /// Mapped out by `Hide`, with the bytes kept here: userfaultfd has no read-protection.
    Aside(PageData),
}

#[derive(Debug)]
struct Slot {
    prot: Prot,
    bytes: Bytes,
}

/// Applies a node's page operations to its memory, in the order the node emits them.
///
/// Only the coherence thread populates the region (every access to an absent page stops and
/// comes to it), so this record of which pages are present is exact, and the bytes of a page
/// are read with loads only when the page is present.
#[derive(Debug)]
pub struct Backend {
    memory: Arc<Memory>,
    me: NodeId,
    placement: Arc<dyn Placement>,
    slots: HashMap<PageNo, Slot>,
}

impl Backend {
    pub fn new(memory: Arc<Memory>, me: NodeId, placement: Arc<dyn Placement>) -> Backend {
        Backend {
            memory,
            me,
            placement,
            slots: HashMap::new(),
        }
    }

    pub fn memory(&self) -> &Arc<Memory> {
        &self.memory
    }

    fn slot(&mut self, page: PageNo) -> &mut Slot {
        let held = self.placement.initial_owner(page) == self.me;
        self.slots.entry(page).or_insert(Slot {
            prot: if held { Prot::ReadWrite } else { Prot::None },
            bytes: Bytes::Absent,
        })
    }

    /// Local protection as last set by the protocol (or the initial one).
    pub fn prot(&self, page: PageNo) -> Prot {
        match self.slots.get(&page) {
            Some(s) => s.prot,
            None if self.placement.initial_owner(page) == self.me => Prot::ReadWrite,
            None => Prot::None,
        }
    }

    /// Whether the page is mapped in memory now.
    pub fn is_present(&self, page: PageNo) -> bool {
        matches!(
            self.slots.get(&page),
            Some(Slot {
                bytes: Bytes::Present,
                ..
            })
        )
    }

    /// Carries out one page operation. Threads stopped on the page stay stopped: waking is
    /// `resume`'s job, so nobody retries before the protocol says the access is granted.
    pub fn apply(&mut self, page: PageNo, op: &PageOp) -> Result<(), MemoryError> {
        let mem = Arc::clone(&self.memory);
        mem.page_addr(page)?;
        let slot = self.slot(page);
        match op {
            PageOp::Install { data, writable } => {
                if matches!(slot.bytes, Bytes::Present) {
                    // UFFDIO_COPY only fills absent pages; a local access in between stops
                    // as missing and is resumed like any other.
                    mem.discard(page)?;
                }
                if !mem.install(page, data, *writable)? {
                    // Present although our record said otherwise: the record is the bug.
                    mem.discard(page)?;
                    mem.install(page, data, *writable)?;
                }
                slot.bytes = Bytes::Present;
                slot.prot = if *writable {
                    Prot::ReadWrite
                } else {
                    Prot::ReadOnly
                };
            }
            PageOp::ReadOnly | PageOp::Writable => {
                let writable = matches!(op, PageOp::Writable);
                match std::mem::take(&mut slot.bytes) {
                    Bytes::Present => {
                        mem.write_protect(page, !writable)?;
                        slot.bytes = Bytes::Present;
                    }
                    Bytes::Aside(data) => {
                        mem.install(page, &data, writable)?;
                        slot.bytes = Bytes::Present;
                    }
                    // Zero contents, mapped on the first access (see `resume`).
                    Bytes::Absent => {}
                }
                slot.prot = if writable {
                    Prot::ReadWrite
                } else {
                    Prot::ReadOnly
                };
            }
            PageOp::Hide => {
                if matches!(slot.bytes, Bytes::Present) {
                    // Stop writers first, so the bytes kept are the last ones written.
                    mem.write_protect(page, true)?;
                    let data = mem.read_present(page)?;
                    mem.discard(page)?;
                    slot.bytes = Bytes::Aside(data);
                }
                slot.prot = Prot::None;
            }
            PageOp::Drop => {
                if matches!(slot.bytes, Bytes::Present) {
                    mem.discard(page)?;
                }
                slot.bytes = Bytes::Absent;
                slot.prot = Prot::None;
            }
        }
        Ok(())
    }

    /// The page's current bytes, for sending. Never loads from an absent page.
    pub fn capture(&mut self, page: PageNo) -> Result<PageData, MemoryError> {
        let mem = Arc::clone(&self.memory);
        mem.page_addr(page)?;
        match &self.slot(page).bytes {
            Bytes::Present => mem.read_present(page),
            Bytes::Aside(data) => Ok(data.clone()),
            Bytes::Absent => Ok(dsm::types::zero_page()),
        }
    }

    /// Lets the threads stopped on the page retry. A page the node holds but never mapped
    /// (untouched since start) is mapped as zeros first, with the protection granted.
    pub fn resume(&mut self, page: PageNo) -> Result<(), MemoryError> {
        let mem = Arc::clone(&self.memory);
        let slot = self.slot(page);
        if slot.prot != Prot::None && matches!(slot.bytes, Bytes::Absent) {
            static ZERO: [u8; PAGE_SIZE] = [0; PAGE_SIZE];
            mem.install(page, &ZERO, slot.prot == Prot::ReadWrite)?;
            slot.bytes = Bytes::Present;
        }
        mem.wake(page)
    }
}
