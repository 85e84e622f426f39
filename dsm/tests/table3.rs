//! Table 3 from the simulator, every cell checked against the paper for c = 0..=5.

use dsm::table3::{measure_all, paper, render, ManagerAt};
use dsm::{Access, Protocol};

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

#[test]
fn print_table() {
    let t = render();
    println!("{t}");
    assert!(t.contains("VMP"), "{t}");
}
