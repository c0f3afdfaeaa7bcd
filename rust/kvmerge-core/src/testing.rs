//! Builders of msgspec-shaped events for the crate's own tests and benches.

use crate::batch::Batch;
use crate::msgpack::write_array_header;

/// One event, msgpack-encoded as msgspec encodes vLLM's classes.
pub type Ev = Vec<u8>;

fn str_(out: &mut Vec<u8>, s: &str) {
    assert!(s.len() < 32);
    out.push(0xa0 | s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

fn uint(out: &mut Vec<u8>, v: u64) {
    out.push(0xcf);
    out.extend_from_slice(&v.to_be_bytes());
}

/// `BlockStored` with `n_hashes` hashes derived from `h`, `tokens` token ids.
pub fn stored_with(h: u64, group: Option<u8>, n_hashes: usize, tokens: usize) -> Ev {
    let mut e = vec![0x80 | if group.is_some() { 9 } else { 8 }];
    str_(&mut e, "type");
    str_(&mut e, "BlockStored");
    str_(&mut e, "block_hashes");
    write_array_header(&mut e, n_hashes);
    for i in 0..n_hashes as u64 {
        uint(
            &mut e,
            h.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(i),
        );
    }
    str_(&mut e, "parent_block_hash");
    e.push(0xc0);
    str_(&mut e, "token_ids");
    write_array_header(&mut e, tokens);
    for t in 0..tokens {
        e.extend_from_slice(&[0xcd, (t >> 8) as u8, t as u8]);
    }
    str_(&mut e, "block_size");
    e.push(16);
    str_(&mut e, "lora_id");
    e.push(0xc0);
    str_(&mut e, "medium");
    str_(&mut e, "CPU");
    str_(&mut e, "lora_name");
    e.push(0xc0);
    if let Some(g) = group {
        str_(&mut e, "group_idx");
        e.push(g);
    }
    e
}

pub fn stored(h: u8, group: Option<u8>) -> Ev {
    stored_with(h as u64, group, 1, 4)
}

pub fn removed(h: u8) -> Ev {
    let mut e = vec![0x83];
    str_(&mut e, "type");
    str_(&mut e, "BlockRemoved");
    str_(&mut e, "block_hashes");
    e.extend_from_slice(&[0x91, h & 0x7f]);
    str_(&mut e, "medium");
    e.push(0xc0);
    e
}

pub fn clear() -> Ev {
    let mut e = vec![0x81];
    str_(&mut e, "type");
    str_(&mut e, "AllBlocksCleared");
    e
}

/// msgspec's encoding of the list of `events`.
pub fn payload(events: &[Ev]) -> Vec<u8> {
    let mut p = Vec::new();
    write_array_header(&mut p, events.len());
    for e in events {
        p.extend_from_slice(e);
    }
    p
}

pub fn batch(events: &[Ev]) -> Batch {
    Batch::encode(&payload(events)).expect("test events are well formed")
}
