//! Damaged batches that carry a *valid* checksum, and what receiving them
//! gets: the rows of docs/robustness.md that Python cannot produce without
//! an XXH3 implementation (tests/support/bad_inputs.py prints the others).
//!
//! ```text
//! cargo run -q -p kvmerge-core --example bad_batches
//! ```
//!
//! `EventBatch.from_buffer` raises `CorruptBatchError` with exactly the
//! message printed here (the binding maps `Error::CorruptBatch`, keeping its
//! text).

use kvmerge_core::batch::{HEADER_LEN, RECORD_LEN};
use kvmerge_core::testing::{batch, removed, reseal, stored};
use kvmerge_core::Batch;

/// A valid batch of two events, as received bytes.
fn good() -> Vec<u8> {
    batch(&[stored(1, Some(0)), removed(2)]).bytes().to_vec()
}

/// Edits the bytes, then recomputes the checksum as a forger would.
fn forged(edit: impl Fn(&mut Vec<u8>)) -> Vec<u8> {
    let mut b = good();
    edit(&mut b);
    reseal(&mut b);
    b
}

fn record(i: usize) -> usize {
    HEADER_LEN + i * RECORD_LEN
}

fn payload_start() -> usize {
    record(2)
}

fn main() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "payload array of 1 for 2 records",
            forged(|b| b[payload_start()] = 0x91),
        ),
        (
            "payload is not an array",
            forged(|b| b[payload_start()] = 0xc0),
        ),
        ("record kind 9", forged(|b| b[record(0) + 24] = 9)),
        ("record flags 0x04", forged(|b| b[record(0) + 25] = 4)),
        (
            "record marked as not carried, with a length",
            forged(|b| b[record(0) + 25] = 2),
        ),
        (
            "record reserved byte set",
            forged(|b| b[record(1) + 26] = 1),
        ),
        (
            "record offset inside the previous event",
            forged(|b| b[record(1) + 16] -= 1),
        ),
        (
            "record length 0",
            forged(|b| b[record(1) + 20..record(1) + 24].fill(0)),
        ),
        (
            "records stop short of the payload's end",
            forged(|b| b[record(1) + 20] -= 1),
        ),
    ];
    println!("| # | forged batch (valid checksum) | exception | message |");
    println!("| --- | --- | --- | --- |");
    for (i, (label, bytes)) in cases.into_iter().enumerate() {
        let (kind, message) = match Batch::from_vec(bytes) {
            Ok(_) => ("accepted".to_string(), String::new()),
            Err(e) => ("CorruptBatchError (ValueError)".to_string(), e.to_string()),
        };
        println!("| {} | {label} | {kind} | {message} |", i + 1);
    }
}
