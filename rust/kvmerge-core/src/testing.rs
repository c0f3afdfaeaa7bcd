//! Builders of msgspec-shaped events for the crate's own tests and benches.

use crate::batch::Batch;
use crate::msgpack::{self, write_array_header};
use crate::schema::BlockHash;

/// One event, msgpack-encoded as msgspec encodes vLLM's classes.
pub type Ev = Vec<u8>;

/// A short msgpack str (field names, tags), as msgspec writes it.
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    msgpack::write_str(out, s.as_bytes());
}

pub use crate::msgpack::write_uint;

/// A `BlockStored`'s fields after `token_ids`: block size 16, medium "CPU",
/// no LoRA, and `group_idx` when given (the map header must count it).
pub fn write_stored_tail(e: &mut Vec<u8>, group: Option<u8>) {
    write_str(e, "block_size");
    e.push(16);
    write_str(e, "lora_id");
    e.push(0xc0);
    write_str(e, "medium");
    write_str(e, "CPU");
    write_str(e, "lora_name");
    e.push(0xc0);
    if let Some(g) = group {
        write_str(e, "group_idx");
        e.push(g);
    }
}

/// `BlockStored` with `n_hashes` hashes derived from `h`, `tokens` token ids.
pub fn stored_with(h: u64, group: Option<u8>, n_hashes: usize, tokens: usize) -> Ev {
    let mut e = vec![0x80 | if group.is_some() { 9 } else { 8 }];
    write_str(&mut e, "type");
    write_str(&mut e, "BlockStored");
    write_str(&mut e, "block_hashes");
    write_array_header(&mut e, n_hashes);
    for i in 0..n_hashes as u64 {
        write_uint(
            &mut e,
            h.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(i),
        );
    }
    write_str(&mut e, "parent_block_hash");
    e.push(0xc0);
    write_str(&mut e, "token_ids");
    write_array_header(&mut e, tokens);
    for t in 0..tokens {
        e.extend_from_slice(&[0xcd, (t >> 8) as u8, t as u8]);
    }
    write_stored_tail(&mut e, group);
    e
}

pub fn stored(h: u8, group: Option<u8>) -> Ev {
    stored_with(h as u64, group, 1, 4)
}

pub fn removed(h: u8) -> Ev {
    let mut e = vec![0x83];
    write_str(&mut e, "type");
    write_str(&mut e, "BlockRemoved");
    write_str(&mut e, "block_hashes");
    e.extend_from_slice(&[0x91, h & 0x7f]);
    write_str(&mut e, "medium");
    e.push(0xc0);
    e
}

fn write_hash(e: &mut Vec<u8>, h: BlockHash<'_>) {
    match h {
        BlockHash::Int(v) if v >= 0 => write_uint(e, v as u64),
        BlockHash::Int(v) => msgpack::write_int(e, v as i64),
        BlockHash::Bytes(b) => msgpack::write_bin(e, b),
    }
}

fn write_medium(e: &mut Vec<u8>, medium: Option<&str>) {
    write_str(e, "medium");
    match medium {
        Some(m) => write_str(e, m),
        None => e.push(0xc0),
    }
}

/// `BlockStored` of `hashes` (one token id each), child of `parent`, in
/// `medium`.
pub fn stored_blocks(
    hashes: &[BlockHash<'_>],
    parent: Option<BlockHash<'_>>,
    medium: Option<&str>,
) -> Ev {
    stored_blocks_in(hashes, parent, medium, None)
}

/// `stored_blocks` of KV cache group `group`, when given.
pub fn stored_blocks_in(
    hashes: &[BlockHash<'_>],
    parent: Option<BlockHash<'_>>,
    medium: Option<&str>,
    group: Option<u8>,
) -> Ev {
    let mut e = vec![0x88 + group.is_some() as u8];
    write_str(&mut e, "type");
    write_str(&mut e, "BlockStored");
    write_str(&mut e, "block_hashes");
    write_array_header(&mut e, hashes.len());
    hashes.iter().for_each(|&h| write_hash(&mut e, h));
    write_str(&mut e, "parent_block_hash");
    match parent {
        Some(p) => write_hash(&mut e, p),
        None => e.push(0xc0),
    }
    write_str(&mut e, "token_ids");
    write_array_header(&mut e, hashes.len());
    (0..hashes.len()).for_each(|t| write_uint(&mut e, t as u64));
    write_str(&mut e, "block_size");
    e.push(1);
    write_str(&mut e, "lora_id");
    e.push(0xc0);
    write_medium(&mut e, medium);
    write_str(&mut e, "lora_name");
    e.push(0xc0);
    if let Some(g) = group {
        write_str(&mut e, "group_idx");
        e.push(g);
    }
    e
}

/// `BlockRemoved` of `hashes` in `medium`.
pub fn removed_blocks(hashes: &[BlockHash<'_>], medium: Option<&str>) -> Ev {
    let mut e = vec![0x83];
    write_str(&mut e, "type");
    write_str(&mut e, "BlockRemoved");
    write_str(&mut e, "block_hashes");
    write_array_header(&mut e, hashes.len());
    hashes.iter().for_each(|&h| write_hash(&mut e, h));
    write_medium(&mut e, medium);
    e
}

pub fn clear() -> Ev {
    let mut e = vec![0x81];
    write_str(&mut e, "type");
    write_str(&mut e, "AllBlocksCleared");
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

/// `e` with one more key, `name`, holding the msgpack value `value` (bytes
/// as written): a field a later vLLM may add. `e` must have a fixmap header.
pub fn with_field(e: &[u8], name: &str, value: &[u8]) -> Ev {
    assert!(
        e[0] & 0xf0 == 0x80 && e[0] & 0x0f < 15,
        "a fixmap with room"
    );
    let mut out = vec![e[0] + 1];
    out.extend_from_slice(&e[1..]);
    write_str(&mut out, name);
    out.extend_from_slice(value);
    out
}

/// Recomputes a batch's checksum after its bytes were edited, as a forger
/// would: what is left for the reader to catch is what the checksum cannot.
pub fn reseal(bytes: &mut [u8]) {
    let sum = xxhash_rust::xxh3::xxh3_64(&bytes[crate::batch::SUMMED_FROM..]);
    bytes[16..24].copy_from_slice(&sum.to_le_bytes());
}
