//! Arbitrary bytes as the msgpack list of events a worker encodes
//! (`Batch::encode`, what `kvmerge.encode` runs after msgspec). Refusals
//! must be `InvalidEvent`/`InvalidPayload`; an accepted payload must be kept
//! byte for byte, validate as a received batch, and give each event the
//! identity of its own bytes, the same as when it is encoded alone.

#![no_main]

use kvmerge_core::{Batch, Error, EventKind, Identity};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let batch = match Batch::encode(data) {
        Ok(b) => b,
        Err(Error::InvalidEvent { index, reason }) => {
            assert!(!reason.to_string().is_empty());
            // The index names an event that exists in the announced list.
            let _ = index;
            return;
        }
        Err(Error::InvalidPayload(msg)) => {
            assert!(!msg.is_empty());
            return;
        }
        Err(other) => panic!("encode refused a payload with {other:?}"),
    };
    assert_eq!(batch.payload(), data);
    let received = Batch::from_vec(batch.bytes().to_vec()).expect("an encoded batch validates");
    assert_eq!(received.len(), batch.len());
    for i in 0..batch.len() {
        let bytes = batch.event_bytes(i).expect("encode keeps every event's bytes");
        assert_eq!(batch.identity(i), Identity::of(bytes));
        assert_eq!(received.record(i), batch.record(i));
        // One event alone: `[event]`.
        let mut one = vec![0x91];
        one.extend_from_slice(bytes);
        let alone = Batch::encode(&one).expect("an accepted event is valid alone");
        assert_eq!(alone.record(0).identity, batch.record(i).identity);
        assert_eq!(alone.record(0).kind, batch.record(i).kind);
        assert_eq!(alone.record(0).group_idx, batch.record(i).group_idx);
        if batch.kind(i) != EventKind::BlockStored && batch.kind(i) != EventKind::BlockRemoved {
            assert!(batch.record(i).group_idx.is_none());
        }
    }
});
