//! An event's identity: XXH3-128 of its canonical encoding.
//! docs/merge-rules.md ("Identity") says why 128 bits of a fast hash stand
//! in for comparing the bytes.

use std::hash::{BuildHasherDefault, Hash, Hasher};

/// Fixed-size key the merger compares instead of events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Identity(pub [u8; 16]);

impl Identity {
    pub fn of(event_bytes: &[u8]) -> Identity {
        Identity(xxhash_rust::xxh3::xxh3_128(event_bytes).to_le_bytes())
    }

    /// Bits independent of those `Hash` uses, for spreading events over ranks.
    pub fn spread(&self) -> u64 {
        u64::from_le_bytes(self.0[8..].try_into().expect("8 bytes"))
    }
}

impl Hash for Identity {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Already uniformly distributed: eight of its bytes are a fine hash.
        state.write_u64(u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes")));
    }
}

/// Passes an `Identity`'s own bits through instead of hashing them again.
#[derive(Default, Clone, Copy)]
pub struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached by keys other than `Identity`; FNV-1a keeps it correct.
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub type IdentityMap<V> = std::collections::HashMap<Identity, V, BuildHasherDefault<PassThrough>>;
pub type IdentitySet = std::collections::HashSet<Identity, BuildHasherDefault<PassThrough>>;
