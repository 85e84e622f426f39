//! The page operations against real anonymous memory under userfaultfd: which accesses stop,
//! with which fault, and what they see once let go.

mod common;

use common::{page_of, pattern, region, toucher, WAIT};
use dsm::{Access, Modulo, NodeId, PageOp, PAGE_SIZE};
use dsm_host::{Backend, FaultKind, Memory};
use std::sync::Arc;

/// Waits for the next fault and checks where and what it is.
fn expect_fault(mem: &Memory, page: u64, kind: FaultKind, access: Access) {
    let f = mem
        .next_fault(Some(WAIT))
        .expect("reading userfaultfd")
        .unwrap_or_else(|| panic!("no fault on page {page} within {WAIT:?}"));
    assert_eq!((f.page, f.kind, f.access), (page, kind, access), "{f:?}");
    assert!(f.thread > 0, "the faulting thread id is reported: {f:?}");
}

fn assert_no_fault(mem: &Memory) {
    assert_eq!(mem.read_fault().expect("reading userfaultfd"), None);
}

#[test]
fn every_page_operation_behaves_as_the_protocol_expects() {
    let mem = region(0, 4);
    // Node 1 of 2: page 0 belongs to node 0 at start, so it is neither held nor mapped here.
    let mut b = Backend::new(Arc::clone(&mem), NodeId(1), Arc::new(Modulo { nodes: 2 }));
    let a = pattern(1);

    // Install read-only: reads go through, a write stops on write-protect until Writable.
    b.apply(
        0,
        &PageOp::Install {
            data: a.clone(),
            writable: false,
        },
    )
    .unwrap();
    assert_eq!(toucher(&mem, 0).read().wait(), a[..]);
    assert_no_fault(&mem);
    let w = toucher(&mem, 0).write(10, 0x5a);
    expect_fault(&mem, 0, FaultKind::WriteProtect, Access::Write);
    assert!(w.still_stopped(), "the write waits for the protocol");
    b.apply(0, &PageOp::Writable).unwrap();
    b.resume(0).unwrap();
    w.wait();
    assert_eq!(b.capture(0).unwrap()[10], 0x5a);

    // Downgrade to read-only: reads go on, the next write stops.
    b.apply(0, &PageOp::ReadOnly).unwrap();
    assert_eq!(toucher(&mem, 0).read().wait()[10], 0x5a);
    let w = toucher(&mem, 0).write(11, 0x6b);
    expect_fault(&mem, 0, FaultKind::WriteProtect, Access::Write);
    b.apply(0, &PageOp::Writable).unwrap();
    b.resume(0).unwrap();
    w.wait();

    // Drop: the next access stops as missing and sees what is installed then.
    b.apply(0, &PageOp::Drop).unwrap();
    assert!(!b.is_present(0));
    let r = toucher(&mem, 0).read();
    expect_fault(&mem, 0, FaultKind::Missing, Access::Read);
    let c = pattern(2);
    b.apply(
        0,
        &PageOp::Install {
            data: c.clone(),
            writable: true,
        },
    )
    .unwrap();
    b.resume(0).unwrap();
    assert_eq!(r.wait(), c[..]);
    // Installed writable: a write needs no fault.
    toucher(&mem, 0).write(0, 0x11).wait();
    assert_no_fault(&mem);

    // Hide: the bytes are kept aside and sent from there, the page is gone from memory, and
    // granting access again brings the same bytes back.
    let mut kept = c.clone();
    kept[0] = 0x11;
    b.apply(0, &PageOp::Hide).unwrap();
    assert!(!b.is_present(0));
    assert_eq!(b.capture(0).unwrap()[..], kept[..]);
    let r = toucher(&mem, 0).read();
    expect_fault(&mem, 0, FaultKind::Missing, Access::Read);
    b.apply(0, &PageOp::ReadOnly).unwrap();
    b.resume(0).unwrap();
    assert_eq!(r.wait(), kept[..]);
    let w = toucher(&mem, 0).write(1, 0x22);
    expect_fault(&mem, 0, FaultKind::WriteProtect, Access::Write);
    b.apply(0, &PageOp::Writable).unwrap();
    b.resume(0).unwrap();
    w.wait();
    assert_eq!(b.capture(0).unwrap()[1], 0x22);
}

#[test]
fn a_page_not_held_is_never_loaded_and_an_untouched_held_page_is_zero() {
    let mem = region(0x10_0000, 2);
    let first = page_of(0x10_0000);
    // Node 0 of 2 holds the even pages at start.
    let mut b = Backend::new(Arc::clone(&mem), NodeId(0), Arc::new(Modulo { nodes: 2 }));
    let held = if first.is_multiple_of(2) {
        first
    } else {
        first + 1
    };
    let other = if held == first { first + 1 } else { first };
    // Capturing an absent page answers zeros without touching it (a load would stop this
    // thread on its own userfaultfd).
    assert!(b.capture(other).unwrap().iter().all(|&x| x == 0));
    assert!(b.capture(held).unwrap().iter().all(|&x| x == 0));
    assert_eq!(b.prot(held), dsm::Prot::ReadWrite);
    assert_eq!(b.prot(other), dsm::Prot::None);

    // First touch of a held page: missing, resumed as zeros, writable at once.
    let w = toucher(&mem, held).write(5, 9);
    expect_fault(&mem, held, FaultKind::Missing, Access::Write);
    b.resume(held).unwrap();
    w.wait();
    assert_no_fault(&mem);
    let got = b.capture(held).unwrap();
    assert_eq!((got[5], got[4], got[PAGE_SIZE - 1]), (9, 0, 0));
    // A page outside the region is refused by name.
    let e = b.apply(first + 2, &PageOp::Drop).unwrap_err().to_string();
    assert!(e.contains("outside the region"), "{e}");
}
