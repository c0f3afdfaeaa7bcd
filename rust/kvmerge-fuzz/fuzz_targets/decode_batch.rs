//! Arbitrary bytes as a received batch (`Batch::from_vec`, what
//! `EventBatch.from_buffer` runs). The only acceptable refusal is
//! `CorruptBatch`; an accepted batch must answer every accessor, and any
//! gathering of its events must be a batch that validates again.
//!
//! Random bytes almost never carry the right XXH3 checksum, which would stop
//! the fuzzer at the first check; so each input is also tried with its
//! checksum recomputed, to reach the structural checks behind it.

#![no_main]

use kvmerge_core::batch::HEADER_LEN;
use kvmerge_core::testing::reseal;
use kvmerge_core::{Batch, Error, Identity};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check(data.to_vec());
    if data.len() >= HEADER_LEN {
        let mut fixed = data.to_vec();
        reseal(&mut fixed);
        check(fixed);
    }
});

fn check(bytes: Vec<u8>) {
    let batch = match Batch::from_vec(bytes.clone()) {
        Ok(b) => b,
        Err(Error::CorruptBatch(msg)) => {
            assert!(!msg.is_empty());
            return;
        }
        Err(other) => panic!("a received buffer was refused with {other:?}"),
    };
    assert_eq!(batch.bytes(), &bytes[..]);
    let n = batch.len();
    assert_eq!(batch.is_empty(), n == 0);
    assert!(batch.payload_start() <= bytes.len());
    assert_eq!(batch.payload(), &bytes[batch.payload_start()..]);
    let ids: Vec<Identity> = batch.identities().collect();
    assert_eq!(ids.len(), n);
    assert!(batch.alike(&batch));
    let mut covered = 0;
    for (i, id) in ids.iter().enumerate() {
        let rec = batch.record(i);
        assert_eq!(rec.identity, *id);
        assert_eq!(batch.identity(i), *id);
        assert_eq!(batch.kind(i), rec.kind);
        let Some(range) = batch.event_range(i) else {
            assert!(!rec.carried && batch.event_bytes(i).is_none());
            continue;
        };
        assert!(rec.carried);
        assert!(range.start < range.end && range.end <= bytes.len());
        assert_eq!(Some(&bytes[range.clone()]), batch.event_bytes(i));
        covered += range.len();
    }
    assert!(covered <= batch.payload().len());

    // Gathering: all events in order, in reverse, and each twice (which
    // takes the output past the 15-element msgpack fixarray when n > 7).
    let orders: [Vec<usize>; 3] = [
        (0..n).collect(),
        (0..n).rev().collect(),
        (0..n).flat_map(|i| [i, i]).collect(),
    ];
    for order in orders {
        let out = Batch::gather(order.iter().map(|&i| (&batch, i)));
        assert_eq!(out.len(), order.len());
        let uncarried = order.iter().filter(|&&i| !batch.carries(i)).count();
        assert_eq!(out.uncarried(), uncarried);
        let again = Batch::from_vec(out.bytes().to_vec()).expect("a gathered batch validates");
        assert_eq!(again.len(), order.len());
        for (k, &i) in order.iter().enumerate() {
            assert_eq!(again.record(k).identity, batch.record(i).identity);
            assert_eq!(again.record(k).kind, batch.record(i).kind);
            assert_eq!(again.record(k).group_idx, batch.record(i).group_idx);
            assert_eq!(again.event_bytes(k), batch.event_bytes(i));
        }
    }
}
