//! The fuzz targets' checks on seeded random inputs, so CI covers them on stable Rust.

use dsm::fuzz;
use dsm::rng::Rng;
use dsm::{Access, Message, NodeId};

fn bytes(rng: &mut Rng, max: u64) -> Vec<u8> {
    let len = rng.below(max + 1) as usize;
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

#[test]
fn decoding_random_and_mutated_bytes_never_panics() {
    let mut rng = Rng::new(0xD5A1);
    let valid = [
        Message::Fetch {
            page: 3,
            access: Access::Write,
            requester: NodeId(1),
        }
        .to_bytes(),
        Message::Inv {
            page: 9,
            access: Access::Read,
            requester: NodeId(0),
            owner: NodeId(2),
        }
        .to_bytes(),
        Message::InvalAck { page: 1 }.to_bytes(),
        Message::PageData {
            page: 2,
            access: Access::Read,
            data: dsm::types::zero_page(),
        }
        .to_bytes(),
    ];
    for i in 0..200_000u64 {
        let input = if i % 2 == 0 {
            bytes(&mut rng, if i % 20 == 0 { 4200 } else { 20 })
        } else {
            let mut v = valid[rng.below(valid.len() as u64) as usize].clone();
            match rng.below(3) {
                0 => {
                    let at = rng.below(v.len() as u64) as usize;
                    v[at] = rng.next_u64() as u8;
                }
                1 => v.truncate(rng.below(v.len() as u64) as usize),
                _ => v.push(rng.next_u64() as u8),
            }
            v
        };
        fuzz::decode(&input).unwrap_or_else(|e| panic!("{input:?}: {e}"));
    }
}

#[test]
fn nodes_survive_arbitrary_event_sequences() {
    let mut rng = Rng::new(0xE7E7);
    for _ in 0..20_000 {
        let input = bytes(&mut rng, 600);
        fuzz::node_events(&input).unwrap_or_else(|e| panic!("{input:?}: {e}"));
    }
}

#[test]
fn small_simulations_from_arbitrary_bytes_hold_their_invariants() {
    let mut rng = Rng::new(0x5151);
    for _ in 0..300 {
        let input = bytes(&mut rng, 24);
        fuzz::simulation(&input).unwrap_or_else(|e| panic!("{input:?}: {e}"));
    }
}
