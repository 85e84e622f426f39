//! Table 3 from the simulator, every cell checked against the paper for c = 0..=5, and the
//! default ordering's cells against the paper's plus what its acknowledgements add.

use dsm::table3::{measure_all, measure_all_ordered, paper, render, tso_extra, ManagerAt};
use dsm::{Access, Ordering, Protocol};

#[test]
fn message_counts_match_the_paper_exactly() {
    for cell in measure_all(5).unwrap() {
        let (msgs, _) = paper(cell.protocol, cell.access, cell.manager, cell.c);
        assert_eq!(cell.messages, msgs, "{cell:?}");
    }
}

#[test]
fn critical_paths_match_the_paper() {
    for cell in measure_all(5).unwrap() {
        let (_, path) = paper(cell.protocol, cell.access, cell.manager, cell.c);
        match (cell.protocol, cell.access) {
            (Protocol::Ivy, Access::Read) => {
                assert_eq!(cell.to_resume, path, "{cell:?}");
                assert_eq!(cell.whole, path, "{cell:?}");
            }
            (Protocol::Ivy, Access::Write) => {
                // The paper's 4 and 5 include one invalidation round trip.
                let expect = if cell.c == 0 { path - 2 } else { path };
                assert_eq!(cell.to_resume, expect, "{cell:?}");
                assert_eq!(cell.whole, expect, "{cell:?}");
            }
            (Protocol::Vmp, Access::Read) => {
                assert_eq!(cell.to_resume, path, "{cell:?}");
                // The finish goes out after the resume.
                let finish = u32::from(cell.manager != ManagerAt::Requester);
                assert_eq!(cell.whole, path + finish, "{cell:?}");
            }
            (Protocol::Vmp, Access::Write) => {
                assert_eq!(cell.whole, path, "{cell:?}");
                let finish = u32::from(cell.manager != ManagerAt::Requester);
                assert_eq!(cell.to_resume, path - finish, "{cell:?}");
            }
        }
    }
}

/// The default ordering: reads as in the paper, writes one acknowledgement per copy more and,
/// with copies, two more messages before the writer resumes (and in the whole fetch).
#[test]
fn tso_ordering_adds_one_acknowledgement_per_copy_to_writes() {
    let paper = measure_all(5).unwrap();
    let tso = measure_all_ordered(Ordering::Tso, 5).unwrap();
    assert_eq!(paper.len(), tso.len());
    for (p, t) in paper.iter().zip(&tso) {
        let (msgs, path) = tso_extra(p.protocol, p.access, p.c);
        assert_eq!(t.messages, p.messages + msgs, "{t:?}");
        assert_eq!(t.to_resume, p.to_resume + path, "{t:?}");
        assert_eq!(t.whole, p.whole + path, "{t:?}");
        if p.protocol == Protocol::Vmp && p.access == Access::Write {
            assert_eq!(msgs, u64::from(p.c), "{t:?}");
        }
    }
}

#[test]
fn print_table() {
    let t = render();
    println!("{t}");
    assert!(t.contains("VMP"), "{t}");
    assert!(t.contains("VMP-TSO"), "{t}");
}
