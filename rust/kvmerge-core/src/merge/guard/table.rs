//! The blocks one medium holds, as the guard keeps them: an open-addressing
//! table of 16-byte keys, laid out so that the guard can ask for an event's
//! slots before it needs them (`prefetch`). A large tier's table outgrows
//! the caches, and a probe that waits for memory costs ~100 ns: the guard
//! asks for the slots of the events a few places ahead, so their lines
//! arrive while it checks the ones before (docs/benchmarks.md, "The guard's
//! table").

use crate::schema::BlockHash;

/// A block hash as the guard keeps it, in 16 bytes: an int (64 bits and a
/// sign at most, as msgpack holds it) offset into `[0, 2^65)`, a bytes
/// hash as its XXH3-128 with the top bit set. So an int and a bytes are
/// never the same key; two bytes hashes are only on a 127-bit collision
/// (docs/merge-rules.md, "Identity", weighs such odds). The one value an
/// empty slot holds is a bytes key's, taken for the one beside it: one more
/// 127-bit collision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Key(u128);

const BYTES_TAG: u128 = 1 << 127;
const EMPTY: Key = Key(u128::MAX);

impl Key {
    pub(super) fn of(h: BlockHash<'_>) -> Key {
        match h {
            BlockHash::Int(v) => Key(v.wrapping_add(1 << 64) as u128),
            BlockHash::Bytes(b) => {
                let k = xxhash_rust::xxh3::xxh3_128(b) | BYTES_TAG;
                Key(if k == EMPTY.0 { k - 1 } else { k })
            }
        }
    }

    /// Ints may be small and dense: a folded multiply spreads every bit of
    /// the key over the slot's index.
    fn spread(self) -> u64 {
        let x = (self.0 as u64) ^ ((self.0 >> 64) as u64).rotate_left(32);
        let p = (x as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (p as u64) ^ ((p >> 64) as u64)
    }
}

/// Slots a table starts with once it holds a key.
const FIRST_SLOTS: usize = 64;
/// At most 7 keys in 10 slots: a linear probe then reads ~2 slots when it
/// finds its key and ~6 (two cache lines) when it does not.
const LOAD: (usize, usize) = (7, 10);

/// A set of keys, linear probing, removals by backward shift (no
/// tombstones, so a table that stores and removes forever stays as short
/// to probe as on its first step).
#[derive(Default)]
pub(super) struct KeyTable {
    /// A power of two in length (or empty); `EMPTY` where no key is.
    slots: Box<[Key]>,
    len: usize,
}

impl KeyTable {
    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    fn home(&self, k: Key) -> usize {
        k.spread() as usize & (self.slots.len() - 1)
    }

    /// Where `k` is, or the empty slot that ends its probe.
    fn find(&self, k: Key) -> Result<usize, usize> {
        let mask = self.slots.len() - 1;
        let mut i = self.home(k);
        loop {
            match self.slots[i] {
                s if s == k => return Ok(i),
                EMPTY => return Err(i),
                _ => i = (i + 1) & mask,
            }
        }
    }

    pub(super) fn contains(&self, k: Key) -> bool {
        self.len > 0 && self.find(k).is_ok()
    }

    /// Adds `k`; false (and no change) when it is held already.
    pub(super) fn insert(&mut self, k: Key) -> bool {
        if (self.len + 1) * LOAD.1 > self.slots.len() * LOAD.0 {
            self.grow();
        }
        match self.find(k) {
            Ok(_) => false,
            Err(i) => {
                self.slots[i] = k;
                self.len += 1;
                true
            }
        }
    }

    /// Takes `k` out; false (and no change) when it is not held.
    pub(super) fn remove(&mut self, k: Key) -> bool {
        if self.len == 0 {
            return false;
        }
        let Ok(mut hole) = self.find(k) else {
            return false;
        };
        // Each key after the hole, up to the next empty slot, moves into it
        // when its probe passes the hole: every key stays reachable from
        // its home without a gap.
        let mask = self.slots.len() - 1;
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s == EMPTY {
                break;
            }
            let home = self.home(s);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Forgets every key, keeping the slots: a cleared tier refills.
    pub(super) fn clear(&mut self) {
        self.slots.fill(EMPTY);
        self.len = 0;
    }

    /// Asks the memory for `k`'s home slot, as a hint: nothing changes, and
    /// a table that grows in between only makes it useless.
    #[inline]
    pub(super) fn prefetch(&self, k: Key) {
        if !self.slots.is_empty() {
            prefetch(&self.slots[self.home(k)]);
        }
    }

    fn grow(&mut self) {
        let n = (self.slots.len() * 2).max(FIRST_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; n].into_boxed_slice());
        for k in old.iter().copied().filter(|&k| k != EMPTY) {
            let Err(i) = self.find(k) else {
                unreachable!("a table's keys are distinct")
            };
            self.slots[i] = k;
        }
    }
}

#[inline(always)]
fn prefetch(slot: &Key) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and never faults;
    // the address is a live slot's anyway.
    #[allow(unused_unsafe)]
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((slot as *const Key).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = slot;
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;

    /// Keys whose homes crowd a small table: runs that wrap around its end,
    /// removals from their middles.
    fn crowded() -> impl Strategy<Value = Key> {
        (0u128..48).prop_map(|k| Key(k << 70))
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(Key),
        Remove(Key),
        Contains(Key),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => crowded().prop_map(Op::Insert),
            4 => crowded().prop_map(Op::Remove),
            3 => crowded().prop_map(Op::Contains),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Against std's set: every answer, and every key reachable after
        /// each operation (a backward shift that left a gap would lose one).
        #[test]
        fn the_table_is_a_set(ops in prop::collection::vec(op(), 0..300)) {
            let (mut t, mut model) = (KeyTable::default(), HashSet::new());
            for op in ops {
                match op {
                    Op::Insert(k) => prop_assert_eq!(t.insert(k), model.insert(k.0)),
                    Op::Remove(k) => prop_assert_eq!(t.remove(k), model.remove(&k.0)),
                    Op::Contains(k) => prop_assert_eq!(t.contains(k), model.contains(&k.0)),
                    Op::Clear => {
                        t.clear();
                        model.clear();
                    }
                }
                prop_assert_eq!(t.len(), model.len());
                for &k in &model {
                    prop_assert!(t.contains(Key(k)));
                }
            }
        }
    }

    #[test]
    fn a_table_grows_and_keeps_every_key() {
        let mut t = KeyTable::default();
        for k in 0..10_000u128 {
            assert!(t.insert(Key(k)));
        }
        assert!(t.slots.len() * LOAD.0 >= t.len() * LOAD.1);
        assert!((0..10_000u128).all(|k| t.contains(Key(k))));
        assert!(!t.contains(Key(10_000)));
        for k in (0..10_000u128).step_by(2) {
            assert!(t.remove(Key(k)));
        }
        assert!((0..10_000u128).all(|k| t.contains(Key(k)) == (k % 2 == 1)));
        assert_eq!(t.len(), 5_000);
    }

    #[test]
    fn an_empty_table_answers_without_slots() {
        let mut t = KeyTable::default();
        assert!(!t.contains(Key(1)));
        assert!(!t.remove(Key(1)));
        t.prefetch(Key(1));
        t.clear();
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn no_bytes_hash_is_the_empty_slot() {
        // Every bytes key has the top bit; none is the empty slot's value,
        // and ints stay below 2^65.
        for b in [&b""[..], b"a", &[0xff; 32]] {
            let k = Key::of(BlockHash::Bytes(b));
            assert!(k.0 & BYTES_TAG != 0 && k != EMPTY);
        }
        for v in [i128::from(i64::MIN), -1, 0, i128::from(u64::MAX)] {
            let k = Key::of(BlockHash::Int(v));
            assert!(k.0 < 1 << 65);
        }
    }
}
