//! Arbitrary sequences of `add(rank, batch)`, `finish_step` and `reset` on a
//! merger, with batches from a small pool (stores in two KV cache groups, a
//! store in a group without a factor, removals, clears, own duplicates).
//!
//! Input format (so seeds can be written by hand, see corpus/merger):
//! byte 0: world size `1 + (b & 3)`, rule `[all, quorum, any][(b >> 2) % 3]`;
//! byte 1: max_pending_steps `[0, 1, 2, 3, 4, 8, u64::MAX / 2, u64::MAX][b & 7]`,
//!         quorum factors `[1 + (b >> 3 & 3), 1 + (b >> 5 & 3)]`;
//! then one op per byte: `< 0xa0`: add pool batch `b & 15` as rank `b >> 4`
//! (ranks 8 and 9 stand for -1 and i64::MAX), `0xa0..0xe0`: finish_step,
//! `0xe0..0xf0`: reset, `>= 0xf0`: `add_all` of the `1 + (b & 3)` batches
//! that the next bytes encode as an add does (missing bytes: fewer batches).
//!
//! Checked after every op, on twin mergers fed the same calls (one closing
//! steps with `finish_step`, the other with `finish_step_general`, which
//! never takes the identical-reports shortcut) and on the naive reference
//! model of examples/soak/reference.rs:
//! - the same calls are refused, with the same error, and a refused call
//!   changes no counter;
//! - the same identities are published, in the same order, with the same
//!   bytes on both twins, and the output validates as a batch;
//! - the counters agree with the model's, and
//!   `reports == consumed + cleared + expired + pending`.

#![no_main]

use std::sync::{Arc, OnceLock};

use kvmerge_core::testing::{batch, clear, removed, stored, Ev};
use kvmerge_core::{Batch, Carriers, Error, Identity, Merger, MergerConfig, Rule, Stats};
use libfuzzer_sys::fuzz_target;

#[path = "../../kvmerge-core/examples/soak/reference.rs"]
mod reference;

use reference::{Counters, Event, Kind, Reference, Rejected};

#[derive(Clone, Copy)]
enum E {
    S(u8, Option<u8>),
    R(u8),
    C,
}

const POOL: [&[E]; 16] = [
    &[],
    &[E::S(1, None)],
    &[E::S(1, None), E::S(2, Some(0))],
    &[E::S(2, Some(0)), E::S(1, None)],
    &[E::R(3)],
    &[E::S(1, None), E::S(1, None)],
    &[E::C],
    &[E::S(1, None), E::C, E::S(2, Some(0))],
    &[E::C, E::S(1, None)],
    &[E::S(4, Some(1))],
    &[E::S(1, None), E::S(2, Some(0)), E::R(3), E::S(4, Some(1))],
    &[E::R(3), E::C, E::R(3)],
    &[E::S(4, Some(1)), E::S(2, Some(0)), E::C, E::C],
    &[E::S(1, None), E::S(2, Some(0)), E::R(3)],
    // Group 7 has no replication factor: refused under "quorum".
    &[E::R(3), E::S(5, Some(7))],
    &[E::S(1, None), E::R(3), E::S(1, None), E::R(3)],
];

struct Pooled {
    batch: Arc<Batch>,
    events: Vec<Event>,
}

fn pool() -> &'static [Pooled] {
    static POOLED: OnceLock<Vec<Pooled>> = OnceLock::new();
    POOLED.get_or_init(|| {
        POOL.iter()
            .map(|evs| {
                let encoded: Vec<(Ev, Kind)> = evs
                    .iter()
                    .map(|e| match *e {
                        E::S(h, g) => (
                            stored(h, g),
                            Kind::Stored {
                                group: g.map(i64::from),
                            },
                        ),
                        E::R(h) => (removed(h), Kind::Removed),
                        E::C => (clear(), Kind::Cleared),
                    })
                    .collect();
                let bytes: Vec<Ev> = encoded.iter().map(|(b, _)| b.clone()).collect();
                Pooled {
                    batch: Arc::new(batch(&bytes)),
                    // The model computes identities from the bytes itself.
                    events: encoded
                        .iter()
                        .map(|(b, kind)| Event {
                            id: Identity::of(b),
                            kind: *kind,
                        })
                        .collect(),
                }
            })
            .collect()
    })
}

fn counters(s: Stats) -> Counters {
    Counters {
        steps: s.steps,
        batches: s.batches,
        reports: s.reports,
        published: s.published,
        consumed: s.consumed,
        cleared: s.cleared,
        expired: s.expired,
        pending: s.pending,
    }
}

fn check_identity(s: Stats) {
    assert_eq!(
        s.reports,
        s.consumed + s.cleared + s.expired + s.pending,
        "{s:?}"
    );
}

fn rejected(e: &Error) -> Rejected {
    match e {
        Error::RankOutOfRange { .. } => Rejected::Rank,
        Error::DuplicateRank { .. } => Rejected::DuplicateRank,
        Error::GroupOutOfRange { .. } => Rejected::Group,
        other => panic!("add refused with {other:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let [b0, b1, ops @ ..] = data else {
        return;
    };
    let w = 1 + (b0 & 3) as usize;
    let rule = [Rule::All, Rule::Quorum, Rule::Any][((b0 >> 2) % 3) as usize];
    let pending = [0, 1, 2, 3, 4, 8, u64::MAX / 2, u64::MAX][(b1 & 7) as usize];
    let factors =
        (rule == Rule::Quorum).then(|| vec![1 + (b1 >> 3 & 3) as u32, 1 + (b1 >> 5 & 3) as u32]);
    let cfg = MergerConfig {
        carriers: Carriers {
            world_size: w,
            rule,
            replication_factors: factors.clone(),
        },
        max_pending_steps: pending,
    };
    let mut fast = Merger::new(cfg.clone()).expect("valid config");
    let mut general = Merger::new(cfg).expect("valid config");
    let mut model = Reference::new(w, rule, factors, pending);
    let pool = pool();

    let report = |b: u8| {
        let rank = match b >> 4 {
            8 => -1,
            9 => i64::MAX,
            r => r as i64,
        };
        (rank, &pool[(b & 15) as usize])
    };
    let mut ops = ops.iter().copied();
    while let Some(op) = ops.next() {
        match op {
            0x00..=0x9f => {
                let (rank, p) = report(op);
                let before = fast.stats();
                let a = fast.add(rank, p.batch.clone());
                let b = general.add(rank, p.batch.clone());
                let m = model.add(rank, p.events.clone());
                assert_eq!(a, b);
                assert_eq!(a.as_ref().map_err(rejected).err(), m.err());
                if a.is_err() {
                    assert_eq!(fast.stats(), before, "a refused add changed the counters");
                }
            }
            0xf0..=0xff => {
                let reports: Vec<(i64, &Pooled)> = ops
                    .by_ref()
                    .take(1 + (op & 3) as usize)
                    .map(report)
                    .collect();
                let batches = || -> Vec<(i64, Arc<Batch>)> {
                    reports.iter().map(|(r, p)| (*r, p.batch.clone())).collect()
                };
                let before = fast.stats();
                let a = fast.add_all(batches());
                let b = general.add_all(batches());
                let m = model.add_all(
                    reports
                        .iter()
                        .map(|(r, p)| (*r, p.events.clone()))
                        .collect(),
                );
                assert_eq!(a, b);
                assert_eq!(a.as_ref().map_err(rejected).err(), m.err());
                if a.is_err() {
                    assert_eq!(
                        fast.stats(),
                        before,
                        "a refused add_all changed the counters"
                    );
                }
            }
            0xa0..=0xdf => {
                let x = fast.finish_step();
                let y = general.finish_step_general();
                let want = model.finish_step();
                let got: Vec<Identity> = x.identities().collect();
                assert_eq!(got, want, "published identities differ from the model");
                assert!(x.identities().eq(y.identities()) && x.alike(&y));
                assert_eq!(x.payload(), y.payload());
                let again = Batch::from_vec(x.bytes().to_vec()).expect("output validates");
                assert_eq!(again.len(), x.len());
            }
            0xe0..=0xef => {
                fast.reset();
                general.reset();
                model.reset();
            }
        }
        let (sa, sb) = (fast.stats(), general.stats());
        assert_eq!(sa, sb);
        check_identity(sa);
        assert_eq!(counters(sa), model.counters());
        assert_eq!(fast.step(), general.step());
    }
});
