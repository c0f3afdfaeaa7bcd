use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::carriers::{Carriers, MAX_WORLD_SIZE};
use crate::identity::Identity;
use crate::testing::{batch, clear, payload, removed, stored, stored_with, with_field, Ev};

fn merger(w: usize, rule: Rule, factors: Option<Vec<u32>>, pending: u64) -> Merger {
    Merger::new(MergerConfig {
        carriers: Carriers {
            world_size: w,
            rule,
            replication_factors: factors,
        },
        max_pending_steps: pending,
    })
    .unwrap()
}

fn ids(b: &Batch) -> Vec<Identity> {
    b.identities().collect()
}

fn ids_of(events: &[Ev]) -> Vec<Identity> {
    ids(&batch(events))
}

#[test]
fn identical_reports_publish_the_sequence() {
    let seq = vec![
        stored(1, None),
        removed(2),
        clear(),
        stored(1, None),
        stored(1, None),
    ];
    for rule in [Rule::All, Rule::Quorum] {
        let factors = (rule == Rule::Quorum).then(|| vec![1]);
        let mut m = merger(4, rule, factors, 2);
        for r in 0..4 {
            m.add(r, Arc::new(batch(&seq))).unwrap();
        }
        let out = m.finish_step();
        let want = match rule {
            Rule::All => ids_of(&seq),
            _ => ids_of(&[stored(1, None), removed(2), clear(), stored(1, None)]),
        };
        assert_eq!(ids(&out), want, "{rule:?}");
        assert_eq!(m.stats().pending, 0);
    }
}

#[test]
fn late_rank_completes_next_step_and_expiry_counts() {
    let mut m = merger(2, Rule::All, None, 1);
    m.add(0, Arc::new(batch(&[removed(1), removed(2)])))
        .unwrap();
    m.add(1, Arc::new(batch(&[removed(2)]))).unwrap();
    assert_eq!(ids(&m.finish_step()), ids_of(&[removed(2)]));
    m.add(1, Arc::new(batch(&[removed(1)]))).unwrap();
    assert_eq!(ids(&m.finish_step()), ids_of(&[removed(1)]));
    // Rank 1 never sends 3: it expires after one extra step.
    m.add(0, Arc::new(batch(&[removed(3)]))).unwrap();
    assert!(m.finish_step().is_empty());
    assert_eq!(m.stats().pending, 1);
    assert!(m.finish_step().is_empty());
    let s = m.stats();
    assert_eq!((s.pending, s.expired), (0, 1));
    assert_eq!(m.slots.live(), 0, "expired batches are dropped");
}

#[test]
fn own_duplicate_never_stands_in_for_another_rank() {
    let mut m = merger(2, Rule::All, None, 0);
    m.add(0, Arc::new(batch(&[removed(1), removed(1)])))
        .unwrap();
    m.add(1, Arc::new(Batch::empty())).unwrap();
    assert!(m.finish_step().is_empty());
    let mut q = merger(2, Rule::Quorum, Some(vec![1]), 0);
    q.add(0, Arc::new(batch(&[removed(1), removed(1)])))
        .unwrap();
    assert!(q.finish_step().is_empty());
}

#[test]
fn quorum_uses_group_factors() {
    // world 4, group 1 replicated on 2 ranks: 2 distinct reports suffice.
    let mut m = merger(4, Rule::Quorum, Some(vec![1, 2]), 4);
    m.add(
        0,
        Arc::new(batch(&[stored(7, Some(1)), stored(8, Some(0))])),
    )
    .unwrap();
    m.add(
        3,
        Arc::new(batch(&[stored(7, Some(1)), stored(8, Some(0))])),
    )
    .unwrap();
    assert_eq!(ids(&m.finish_step()), ids_of(&[stored(7, Some(1))]));
    assert_eq!(m.stats().pending, 2);
}

#[test]
fn clear_discards_what_came_before_it() {
    let mut m = merger(2, Rule::All, None, 8);
    m.add(0, Arc::new(batch(&[removed(1), clear(), removed(2)])))
        .unwrap();
    m.add(1, Arc::new(batch(&[clear(), removed(2), removed(1)])))
        .unwrap();
    assert_eq!(ids(&m.finish_step()), ids_of(&[clear(), removed(2)]));
    let s = m.stats();
    assert_eq!((s.cleared, s.pending), (1, 1));
}

#[test]
fn rejected_calls_change_nothing() {
    let mut m = merger(2, Rule::Quorum, Some(vec![1]), 3);
    assert!(matches!(
        m.add(2, Arc::new(Batch::empty())),
        Err(Error::RankOutOfRange { .. })
    ));
    assert!(matches!(
        m.add(-1, Arc::new(Batch::empty())),
        Err(Error::RankOutOfRange { .. })
    ));
    let bad = Arc::new(batch(&[removed(1), stored(3, Some(1))]));
    assert!(matches!(
        m.add(0, bad),
        Err(Error::GroupOutOfRange {
            index: 1,
            group: 1,
            ..
        })
    ));
    m.add(0, Arc::new(batch(&[removed(1)]))).unwrap();
    assert!(matches!(
        m.add(0, Arc::new(Batch::empty())),
        Err(Error::DuplicateRank { .. })
    ));
    m.add(1, Arc::new(batch(&[removed(1)]))).unwrap();
    assert_eq!(ids(&m.finish_step()), ids_of(&[removed(1)]));
    assert_eq!(m.stats().batches, 2);
}

#[test]
fn add_all_is_all_or_nothing() {
    let mut m = merger(3, Rule::All, None, 3);
    let b = || Arc::new(batch(&[removed(1)]));
    assert!(matches!(
        m.add_all(vec![(0, b()), (2, b()), (0, b())]),
        Err(Error::DuplicateRank { rank: 0, .. })
    ));
    assert!(matches!(
        m.add_all(vec![(1, b()), (3, b())]),
        Err(Error::RankOutOfRange { rank: 3, .. })
    ));
    assert_eq!(m.stats(), Stats::default());
    m.add_all(vec![(2, b()), (0, b()), (1, b())]).unwrap();
    assert_eq!(ids(&m.finish_step()), ids_of(&[removed(1)]));
}

#[test]
fn config_is_checked() {
    let with_factors = |rule, factors| {
        let mut cfg = MergerConfig::new(2, rule);
        cfg.carriers.replication_factors = Some(factors);
        cfg
    };
    let bad = [
        MergerConfig::new(0, Rule::All),
        MergerConfig::new(2, Rule::Quorum),
        with_factors(Rule::Quorum, vec![1, 0]),
        with_factors(Rule::Any, vec![1]),
    ];
    for cfg in bad {
        assert!(matches!(Merger::new(cfg), Err(Error::Config(_))));
    }
    assert!(matches!("most".parse::<Rule>(), Err(Error::Config(_))));
}

#[test]
fn any_is_an_ordered_union() {
    let mut m = merger(2, Rule::Any, None, 0);
    m.add(0, Arc::new(batch(&[removed(1), removed(2), removed(1)])))
        .unwrap();
    m.add(1, Arc::new(batch(&[removed(3), removed(2)])))
        .unwrap();
    assert_eq!(
        ids(&m.finish_step()),
        ids_of(&[removed(1), removed(3), removed(2)])
    );
    m.add(1, Arc::new(batch(&[removed(1)]))).unwrap();
    assert_eq!(ids(&m.finish_step()), ids_of(&[removed(1)]));
    // Only consecutive clears collapse.
    m.add(0, Arc::new(batch(&[clear(), removed(1), clear()])))
        .unwrap();
    m.add(1, Arc::new(batch(&[clear(), removed(1), clear()])))
        .unwrap();
    assert_eq!(
        ids(&m.finish_step()),
        ids_of(&[clear(), removed(1), clear()])
    );
}

/// Same-step multiset intersection, the rule without pending state or
/// clears, written the obvious way.
fn intersection(reports: &[Option<Vec<u8>>], w: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let Some(Some(first)) = reports.first() else {
        return out;
    };
    if reports.iter().filter(|r| r.is_some()).count() < w {
        return out;
    }
    let mut counts: Vec<std::collections::HashMap<u8, usize>> = reports
        .iter()
        .map(|r| {
            let mut c = std::collections::HashMap::new();
            for &e in r.as_ref().unwrap() {
                *c.entry(e).or_insert(0) += 1;
            }
            c
        })
        .collect();
    // Order by position: the j-th copy completes at the greatest
    // (index, rank) of the ranks' j-th reports.
    let mut pubs: Vec<((usize, usize), u8)> = Vec::new();
    for &e in first {
        let m = counts
            .iter()
            .map(|c| c.get(&e).copied().unwrap_or(0))
            .min()
            .unwrap();
        if m == 0 || counts[0][&e] == usize::MAX {
            continue;
        }
        for j in 0..m {
            let at = reports
                .iter()
                .enumerate()
                .map(|(rank, r)| {
                    let r = r.as_ref().unwrap();
                    let at = r
                        .iter()
                        .enumerate()
                        .filter(|(_, &x)| x == e)
                        .nth(j)
                        .unwrap()
                        .0;
                    (at, rank)
                })
                .max()
                .unwrap();
            pubs.push((at, e));
        }
        for c in &mut counts {
            c.insert(e, usize::MAX);
        }
    }
    pubs.sort();
    out.extend(pubs.into_iter().map(|(_, e)| e));
    out
}

/// Rank `r`'s events of one step: 0 a clear, 1 and 2 stores of groups 1
/// and 0, anything else a removal.
fn step_events(reports: &[Option<Vec<u8>>], r: usize) -> Option<Vec<Ev>> {
    reports[r].as_ref().map(|evs| {
        evs.iter()
            .map(|&h| match h {
                0 => clear(),
                1 => stored(1, Some(1)),
                2 => stored(2, Some(0)),
                // A field vLLM 0.33.0 does not have: it travels verbatim.
                5 => with_field(&removed(5), "future", &[0x92, 0x01, 0xa1, b'x']),
                h => removed(h),
            })
            .collect()
    })
}

fn step_reports(w: usize) -> impl Strategy<Value = Vec<Option<Vec<u8>>>> {
    prop::collection::vec(
        prop::option::weighted(0.9, prop::collection::vec(0u8..6, 0..8)),
        w..=w,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn all_matches_multiset_intersection(reports in step_reports(3)) {
        let mut m = merger(3, Rule::All, None, 0);
        for (r, evs) in reports.iter().enumerate() {
            if let Some(evs) = evs {
                let evs: Vec<Ev> = evs.iter().map(|&h| removed(h)).collect();
                m.add(r as i64, Arc::new(batch(&evs))).unwrap();
            }
        }
        let want: Vec<Ev> = intersection(&reports, 3).into_iter().map(removed).collect();
        prop_assert_eq!(ids(&m.finish_step()), ids_of(&want));
        prop_assert_eq!(m.stats().pending, 0);
    }

    /// The shortcut, the rank order of `add` and the counters never change
    /// what the general rules say.
    #[test]
    fn shortcut_and_add_order_change_nothing(
        steps in prop::collection::vec(step_reports(4), 1..6),
        identical in prop::collection::vec(any::<bool>(), 6),
        rule in prop_oneof![Just(Rule::All), Just(Rule::Quorum), Just(Rule::Any)],
        pending in 0u64..3,
        seed in any::<u64>(),
    ) {
        let factors = (rule == Rule::Quorum).then(|| vec![1, 2]);
        let mut a = merger(4, rule, factors.clone(), pending);
        let mut b = merger(4, rule, factors, pending);
        for (s, reports) in steps.iter().enumerate() {
            let mut batches: Vec<(i64, Arc<Batch>)> = Vec::new();
            for r in 0..4 {
                if let Some(evs) = step_events(reports, if identical[s] { 0 } else { r }) {
                    batches.push((r as i64, Arc::new(batch(&evs))));
                }
            }
            for (r, b_) in &batches {
                a.add(*r, b_.clone()).unwrap();
            }
            let n = batches.len();
            for k in 0..n {
                let (r, b_) = &batches[(k + seed as usize) % n];
                b.add(*r, b_.clone()).unwrap();
            }
            let (x, y) = (a.finish_step(), b.finish_step_general());
            prop_assert_eq!(ids(&x), ids(&y));
            prop_assert_eq!(x.payload(), y.payload());
            let (sa, sb) = (a.stats(), b.stats());
            prop_assert_eq!(sa, sb);
            prop_assert_eq!(sa.reports, sa.consumed + sa.cleared + sa.expired + sa.pending);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Ranks that do not carry the bytes other ranks carry change nothing: the
    /// same events, the same bytes, the same counters, on either path.
    #[test]
    fn leaving_bytes_to_carriers_changes_nothing(
        steps in prop::collection::vec(step_reports(4), 1..6),
        identical in prop::collection::vec(any::<bool>(), 6),
        rule in prop_oneof![Just(Rule::All), Just(Rule::Quorum), Just(Rule::Any)],
        pending in 0u64..3,
        general in any::<bool>(),
    ) {
        let factors = (rule == Rule::Quorum).then(|| vec![1, 2]);
        let mut full = merger(4, rule, factors.clone(), pending);
        let mut lean = merger(4, rule, factors, pending);
        let carriers = lean.config().carriers.clone();
        for (s, reports) in steps.iter().enumerate() {
            for r in 0..4 {
                let evs = step_events(reports, if identical[s] { 0 } else { r });
                if let Some(evs) = evs {
                    full.add(r as i64, Arc::new(batch(&evs))).unwrap();
                    let b = Batch::encode_for(&payload(&evs), Some((&carriers, r))).unwrap();
                    lean.add(r as i64, Arc::new(b)).unwrap();
                }
            }
            let x = full.finish_step();
            let y = if general { lean.finish_step_general() } else { lean.finish_step() };
            prop_assert_eq!(y.uncarried(), 0);
            prop_assert_eq!(ids(&x), ids(&y));
            prop_assert_eq!(x.payload(), y.payload());
            prop_assert_eq!(full.stats(), lean.stats());
        }
    }
}

/// Events with fields the schema does not know (a later vLLM's) merge by
/// their whole bytes and are published verbatim, under every rule, on both
/// paths, with every byte present or left to the carriers.
#[test]
fn unknown_fields_travel_verbatim_and_take_part_in_the_identity() {
    let future = |e: Ev| with_field(&e, "future_field", &[0x92, 0x07, 0xc0]);
    let seq = vec![
        future(stored(1, Some(0))),
        future(removed(2)),
        future(clear()),
        future(stored(3, None)),
    ];
    let plain = batch(&[stored(1, Some(0)), removed(2), clear(), stored(3, None)]);
    let ours = batch(&seq);
    for (i, e) in seq.iter().enumerate() {
        assert_ne!(ours.identity(i), plain.identity(i));
        assert_eq!(ours.event_bytes(i), Some(&e[..]));
    }
    for rule in [Rule::All, Rule::Quorum, Rule::Any] {
        let factors = (rule == Rule::Quorum).then(|| vec![2]);
        for general in [false, true] {
            for lean in [false, true] {
                let mut m = merger(4, rule, factors.clone(), 1);
                let carriers = m.config().carriers.clone();
                for r in 0..4 {
                    let b = if lean {
                        Batch::encode_for(&payload(&seq), Some((&carriers, r))).unwrap()
                    } else {
                        batch(&seq)
                    };
                    m.add(r as i64, Arc::new(b)).unwrap();
                }
                let out = if general {
                    m.finish_step_general()
                } else {
                    m.finish_step()
                };
                assert_eq!(out.payload(), ours.payload(), "{rule:?} {general} {lean}");
                assert_eq!(ids(&out), ids(&ours));
            }
        }
    }
    // The same event without the field is another event: under "all" it
    // does not complete the one with it.
    let mut m = merger(2, Rule::All, None, 0);
    m.add(0, Arc::new(batch(&[future(removed(2))]))).unwrap();
    m.add(1, Arc::new(batch(&[removed(2)]))).unwrap();
    assert!(m.finish_step().is_empty());
    assert_eq!(m.stats().expired, 2);
}

#[test]
fn not_carrying_bytes_a_rank_must_carry_is_refused() {
    let evs: Vec<Ev> = (3..40).map(removed).collect();
    // Encoded for a world of 4, added to a merger of 2: rank 0 does not
    // carry the events a world of 4 gives to ranks 2 and 3, some of which a
    // world of 2 gives to rank 0.
    let four = Carriers::new(4, Rule::All);
    let b = Arc::new(Batch::encode_for(&payload(&evs), Some((&four, 0))).unwrap());
    assert!(b.uncarried() > 0);
    let mut m = merger(2, Rule::All, None, 2);
    let before = m.stats();
    let err = m.add(0, b.clone()).unwrap_err();
    assert!(
        matches!(&err, Error::Config(msg) if msg.contains("must carry")),
        "{err:?}"
    );
    assert_eq!(m.stats(), before);
    // The same batch is fine for the world it was encoded for.
    let mut m4 = merger(4, Rule::All, None, 2);
    m4.add(0, b).unwrap();
}

#[test]
fn encode_for_checks_its_config() {
    let p = payload(&[removed(3)]);
    let carriers = Carriers::new(2, Rule::All);
    assert!(matches!(
        Batch::encode_for(&p, Some((&carriers, 2))),
        Err(Error::RankOutOfRange { .. })
    ));
    let bad = Carriers::new(2, Rule::Quorum);
    assert!(matches!(
        Batch::encode_for(&p, Some((&bad, 0))),
        Err(Error::Config(_))
    ));
}

// -- regressions found by fuzzing (rust/kvmerge-fuzz, docs/robustness.md) ----

/// fuzz `merger`, crash-833fab19: `step + max_pending_steps` overflowed
/// (a panic with overflow checks, and without them a wrap that expired every
/// report at once) once a report from step 1 met a horizon of `u64::MAX`.
#[test]
fn huge_horizon_never_expires() {
    for horizon in [u64::MAX, u64::MAX - 1, u64::MAX / 2 + 2] {
        let mut m = merger(2, Rule::All, None, horizon);
        m.finish_step();
        m.add(1, Arc::new(batch(&[removed(1), removed(2)])))
            .unwrap();
        for _ in 0..3 {
            assert!(m.finish_step().is_empty());
        }
        let s = m.stats();
        assert_eq!((s.pending, s.expired), (2, 0), "horizon {horizon}");
        m.add(0, Arc::new(batch(&[removed(2)]))).unwrap();
        assert_eq!(ids(&m.finish_step()), ids_of(&[removed(2)]));
    }
}

/// Found while listing bad inputs (docs/robustness.md), not by the fuzzer:
/// `Merger(world_size=2**31)` passed validation (the bound was u32::MAX) and
/// then allocated per-rank state for two billion ranks (about 80 GiB).
#[test]
fn world_size_is_bounded() {
    for w in [MAX_WORLD_SIZE + 1, u32::MAX as usize, usize::MAX] {
        let err = Merger::new(MergerConfig::new(w, Rule::All)).err();
        assert!(
            matches!(&err, Some(Error::Config(m)) if m.contains("world_size")),
            "{w}: {err:?}"
        );
    }
    let m = Merger::new(MergerConfig::new(MAX_WORLD_SIZE, Rule::Any)).unwrap();
    assert_eq!(m.config().carriers.world_size, MAX_WORLD_SIZE);
}

/// One step's output is one batch (32-bit offsets). Reported by issue 12:
/// world 2, rule "all", one rank adding the same 4 MiB event for 1,024
/// steps, then the other rank's batch completing all of them, made a merged
/// output over 4 GiB, and `finish_step` panicked building it. Now the batch
/// that would let the pending reports' bytes exceed one batch is refused,
/// with nothing changed.
#[test]
fn pending_bytes_are_bounded_by_one_output_batch() {
    // About 4 MiB of bytes (one Arc: the adds share it, memory stays small).
    let big = Arc::new(batch(&[stored_with(7, None, 466_034, 0)]));
    let e = big.carried_len() as u64;
    assert!(e > 4 << 20, "{e}");
    let fits = MAX_CARRIED_BYTES / e;
    let mut m = merger(2, Rule::All, None, 4096);
    for _ in 0..fits {
        m.add(0, big.clone()).unwrap();
        assert!(m.finish_step().is_empty());
    }
    let before = m.stats();
    let step = m.step();
    let err = m.add(0, big.clone()).unwrap_err();
    assert!(
        matches!(&err, Error::TooLarge(msg) if msg.contains("drop this batch")),
        "{err:?}"
    );
    let err = m
        .add_all(vec![(1, Arc::new(Batch::empty())), (0, big.clone())])
        .unwrap_err();
    assert!(matches!(err, Error::TooLarge(_)), "{err:?}");
    assert_eq!((m.stats(), m.step()), (before, step));
    // Small reports still fit (conservatively, the bound counts every
    // carried copy: the other rank's copy of the big event would not).
    m.add(0, Arc::new(batch(&[removed(1)]))).unwrap();
    assert!(matches!(m.add(1, big.clone()), Err(Error::TooLarge(_))));
    m.add(1, Arc::new(batch(&[removed(1)]))).unwrap();
    assert_eq!(ids(&m.finish_step()), ids_of(&[removed(1)]));
    m.reset();
    assert_eq!(m.slots.load(), (0, 0));
    m.add(0, big.clone()).unwrap();
}

/// The load the bound reads goes back to zero when the reports go.
#[test]
fn slot_load_follows_the_pending_reports() {
    for rule in [Rule::All, Rule::Quorum, Rule::Any] {
        let factors = (rule == Rule::Quorum).then(|| vec![1]);
        let mut m = merger(3, rule, factors, 2);
        let a = Arc::new(batch(&[removed(1), stored(2, Some(0)), clear()]));
        let b = Arc::new(batch(&[removed(1), removed(3)]));
        m.add(0, a.clone()).unwrap();
        m.add(1, b.clone()).unwrap();
        m.finish_step();
        m.add(2, a.clone()).unwrap();
        m.finish_step();
        for _ in 0..3 {
            m.finish_step();
        }
        assert_eq!(m.stats().pending, 0, "{rule:?}");
        assert_eq!((m.slots.load(), m.incoming_load), ((0, 0), (0, 0)));
    }
}

/// A step's reports for `prefix_mode_changes_nothing`: the rank's copy of a
/// shared sequence, mostly (a late rank reports the step before's).
fn straggler_events(seq: &[u8]) -> Vec<Ev> {
    seq.iter()
        .map(|&h| match h {
            0 => clear(),
            1 => stored(1, Some(1)),
            2 => stored(2, Some(0)),
            h => removed(h),
        })
        .collect()
}

/// The three mergers the shortcut properties compare (rule "quorum" with
/// factors 1 and 2, or "all"): one with its shortcuts (held batches), one
/// on the general path in prefix mode, one on the index alone; and the
/// steps' sequences for that rule (factor 2 only exists under "quorum":
/// its id becomes another of factor 1).
fn shortcut_general_index(
    w: usize,
    quorum: bool,
    pending: u64,
    seqs: Vec<Vec<u8>>,
) -> ([Merger; 3], Vec<Vec<u8>>) {
    let rule = if quorum { Rule::Quorum } else { Rule::All };
    let factors = quorum.then(|| vec![1, 2]);
    let seqs = if quorum {
        seqs
    } else {
        seqs.into_iter()
            .map(|s| s.into_iter().map(|h| if h == 1 { 3 } else { h }).collect())
            .collect()
    };
    let held = merger(w, rule, factors.clone(), pending);
    let prefix = merger(w, rule, factors.clone(), pending);
    let mut index = merger(w, rule, factors, pending);
    index.index_only = true;
    index.indexed = true;
    ([held, prefix, index], seqs)
}

/// Rank `r`'s events of a step: the shared sequence `seq`, and what the odd
/// rank of the step (if it is `r`) reports besides.
fn rank_events(seq: &[u8], odd: &Option<(usize, Vec<u8>)>, r: usize) -> Vec<Ev> {
    let mut evs = straggler_events(seq);
    if let Some((who, extra)) = odd {
        if *who == r {
            evs.extend(straggler_events(extra));
        }
    }
    evs
}

/// One step of `shortcut_general_index`'s mergers: each rank's events of
/// `adds` added to all three, the step finished; publications, counters and
/// load must agree.
fn finish_alike(
    [held, prefix, index]: &mut [Merger; 3],
    adds: Vec<(usize, Vec<Ev>)>,
    s: usize,
) -> std::result::Result<(), TestCaseError> {
    for (r, evs) in adds {
        let x = Arc::new(batch(&evs));
        for m in [&mut *held, &mut *prefix, &mut *index] {
            m.add(r as i64, x.clone()).unwrap();
        }
    }
    prop_assert_eq!(held.load(), prefix.load(), "step {}", s);
    let (x, y, z) = (
        held.finish_step(),
        prefix.finish_step_general(),
        index.finish_step_general(),
    );
    prop_assert_eq!(ids(&x), ids(&z), "step {}", s);
    prop_assert_eq!(ids(&y), ids(&z), "step {}", s);
    prop_assert_eq!(x.payload(), z.payload());
    prop_assert_eq!(y.payload(), z.payload());
    prop_assert_eq!(held.stats(), index.stats(), "step {}", s);
    prop_assert_eq!(prefix.stats(), index.stats(), "step {}", s);
    prop_assert_eq!(held.load(), prefix.load(), "step {}", s);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The prefix walk ("all", and "quorum" while every report needs every
    /// rank) publishes what the index does, and batches held whole (a rank
    /// late or silent, the others identical) what the general path does, in
    /// the same order, with the same counters and load, step by step: one
    /// rank late, silent or sending empty batches, duplicates, clears, the
    /// odd deviating rank, reports with factor 2, every horizon from 0.
    #[test]
    fn prefix_mode_and_held_batches_change_nothing(
        seqs in prop::collection::vec(prop::collection::vec(0u8..9, 0..7), 1..10),
        late in prop::collection::vec(any::<bool>(), 10),
        silent in prop::collection::vec(prop::bool::weighted(0.15), 10),
        odd in prop::collection::vec(prop::option::weighted(0.15, (0usize..3, prop::collection::vec(0u8..9, 0..4))), 10),
        quorum in any::<bool>(),
        pending in 0u64..4,
        w in 1usize..4,
    ) {
        let (mut mergers, seqs) = shortcut_general_index(w, quorum, pending, seqs);
        for s in 0..seqs.len() + 2 {
            let mut adds: Vec<(usize, Vec<Ev>)> = Vec::new();
            for r in 0..w {
                let last = r == w - 1;
                if last && silent[s % silent.len()] {
                    // Silent, or an empty batch: nothing to report.
                    if s % 2 == 0 {
                        adds.push((r, Vec::new()));
                    }
                    continue;
                }
                let late_here = last && late[s % late.len()];
                let src = if late_here { s.checked_sub(1) } else { Some(s) };
                // Before its first step, a late rank has nothing to report.
                let seq = src.and_then(|k| seqs.get(k)).map_or(&[][..], |q| &q[..]);
                adds.push((r, rank_events(seq, &odd[s % odd.len()], r)));
            }
            finish_alike(&mut mergers, adds, s)?;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A rank silent for many steps (its peers' batches held whole, step
    /// after step, and expiring whole) publishes and counts what the general
    /// path and the index do, step by step: silent for a span of up to 40
    /// steps (sending nothing, or empty batches), then back on time or a
    /// step late; the others now and then reporting nothing at all or one
    /// of them something else; every horizon from 0.
    #[test]
    fn a_rank_silent_for_many_steps_changes_nothing(
        seqs in prop::collection::vec(prop::collection::vec(0u8..9, 0..5), 1..45),
        silent_from in 0usize..10,
        silent_len in 0usize..40,
        empty in prop::collection::vec(any::<bool>(), 7),
        quiet in prop::collection::vec(prop::bool::weighted(0.1), 11),
        odd in prop::collection::vec(prop::option::weighted(0.05, (0usize..4, prop::collection::vec(0u8..9, 0..3))), 13),
        late_after in any::<bool>(),
        quorum in any::<bool>(),
        pending in 0u64..7,
        w in 2usize..5,
    ) {
        let (mut mergers, seqs) = shortcut_general_index(w, quorum, pending, seqs);
        let silent = silent_from..silent_from + silent_len;
        for s in 0..seqs.len() + 2 {
            let mut adds: Vec<(usize, Vec<Ev>)> = Vec::new();
            let nobody = quiet[s % quiet.len()];
            for r in 0..w {
                let last = r == w - 1;
                if nobody || (last && silent.contains(&s)) {
                    if empty[(s + r) % empty.len()] {
                        adds.push((r, Vec::new()));
                    }
                    continue;
                }
                let late_here = last && late_after && s >= silent.end;
                let src = if late_here { s.checked_sub(1) } else { Some(s) };
                let seq = src.and_then(|k| seqs.get(k)).map_or(&[][..], |q| &q[..]);
                adds.push((r, rank_events(seq, &odd[s % odd.len()], r)));
            }
            finish_alike(&mut mergers, adds, s)?;
        }
    }
}

/// A silent rank's peers' batches are held whole step after step, nothing
/// queued, and expire whole after `max_pending_steps`; when the rank comes
/// back, the held batches are queued as the general path would have them.
#[test]
fn a_silent_rank_holds_its_peers_batches_whole() {
    let horizon = 4;
    let mut m = merger(3, Rule::All, None, horizon);
    let mut general = merger(3, Rule::All, None, horizon);
    let step = |s: u8| -> Vec<Ev> { (0..5).map(|i| removed(10 * s + i)).collect() };
    for s in 0..10u8 {
        for r in 0..2 {
            let x = Arc::new(batch(&step(s)));
            m.add(r, x.clone()).unwrap();
            general.add(r, x).unwrap();
        }
        assert!(ids(&m.finish_step()).is_empty());
        assert!(ids(&general.finish_step_general()).is_empty());
        let held = (s as usize + 1).min(horizon as usize);
        assert!(m.held.iter().take(2).all(|h| h.len() == held), "step {s}");
        assert!(m.held[2].is_empty() && m.queues.iter().all(|q| q.nodes.is_empty()));
        assert_eq!(m.stats(), general.stats(), "step {s}");
        assert_eq!(m.load(), general.load(), "step {s}");
    }
    assert_eq!(m.stats().expired, 2 * 5 * (10 - horizon));
    assert_eq!(m.stats().pending, 2 * 5 * horizon);
    // Back, with the oldest step still pending: published from the queues.
    for r in 0..2 {
        let x = Arc::new(batch(&step(10)));
        m.add(r, x.clone()).unwrap();
        general.add(r, x).unwrap();
    }
    let x = Arc::new(batch(&step(6)));
    m.add(2, x.clone()).unwrap();
    general.add(2, x).unwrap();
    let (a, b) = (m.finish_step(), general.finish_step_general());
    assert_eq!(ids(&a), ids_of(&step(6)));
    assert_eq!(ids(&a), ids(&b));
    assert!(m.held.iter().all(VecDeque::is_empty));
    assert_eq!(m.stats(), general.stats());
}

#[test]
fn a_late_rank_completes_held_batches() {
    let mut m = merger(3, Rule::All, None, 4);
    let step = |s: u8| -> Vec<Ev> { (0..5).map(|i| removed(10 * s + i)).collect() };
    let mut published = Vec::new();
    for s in 0..6u8 {
        for r in 0..2 {
            m.add(r, Arc::new(batch(&step(s)))).unwrap();
        }
        // Rank 2 is one step late; at first it has nothing to report (an
        // empty batch, as the connector's workers send).
        let late = if s > 0 { step(s - 1) } else { Vec::new() };
        m.add(2, Arc::new(batch(&late))).unwrap();
        let out = m.finish_step();
        assert!(m.held.iter().take(2).all(|h| h.len() == 1), "step {s}");
        assert!(
            m.queues.iter().all(|q| q.nodes.is_empty()),
            "nothing queued"
        );
        published.push(ids(&out));
    }
    assert!(published[0].is_empty());
    for s in 1..6u8 {
        assert_eq!(published[s as usize], ids_of(&step(s - 1)));
    }
    assert_eq!(m.stats().pending, 10);
    // Anything else queues the held batches first: rank 2 silent, then back.
    m.add(0, Arc::new(batch(&step(6)))).unwrap();
    m.finish_step();
    assert!(m.held.iter().all(VecDeque::is_empty));
    m.add(2, Arc::new(batch(&step(5)))).unwrap();
    m.add(1, Arc::new(batch(&step(6)))).unwrap();
    assert_eq!(ids(&m.finish_step()), ids_of(&step(5)));
}

/// Under "quorum", two reports of one identity in one segment are one
/// publication: a batch is held only if that cannot join it to the held
/// events (the same identity in the next batch, or a clear inside it).
#[test]
fn quorum_holds_only_what_stays_one_segment_apart() {
    let cases: [&[&[u8]]; 3] = [
        &[&[3], &[3], &[5], &[]],
        &[&[3], &[4], &[5], &[]],
        &[&[3, 0, 3], &[4], &[5], &[]],
    ];
    for seqs in cases {
        let mut a = merger(2, Rule::Quorum, Some(vec![1, 2]), 4);
        let mut b = merger(2, Rule::Quorum, Some(vec![1, 2]), 4);
        // Rank 1 one step late.
        for s in 0..seqs.len() {
            let mut adds = vec![(0, seqs[s])];
            if s > 0 {
                adds.push((1, seqs[s - 1]));
            }
            for (r, seq) in adds {
                if s + 1 == seqs.len() && r == 0 {
                    continue;
                }
                let x = Arc::new(batch(&straggler_events(seq)));
                a.add(r, x.clone()).unwrap();
                b.add(r, x).unwrap();
            }
            let (x, y) = (a.finish_step(), b.finish_step_general());
            assert_eq!(ids(&x), ids(&y), "{seqs:?} step {s}");
            assert_eq!(a.stats(), b.stats(), "{seqs:?} step {s}");
        }
    }
}

/// A batch whose digest lies (copied from another rank's, its checksum
/// recomputed: only a forger's batch does) never makes the shortcut publish
/// an event without its bytes: where no rank carries one, the step takes
/// the general path. No panic, every published event carried and reported.
#[test]
fn a_digest_that_lies_publishes_nothing_without_its_bytes() {
    let carriers = Carriers::new(2, Rule::All);
    let first = |h: u8| carriers.first(&batch(&[removed(h)]).identity(0));
    // Event 0: rank 0 reports one only rank 1 carries, rank 1 one only rank 0 does.
    let h0 = (0..=255u8).find(|&h| first(h) == 1).unwrap();
    let h1 = (0..=255u8).find(|&h| first(h) == 0).unwrap();
    let evs0 = vec![removed(h0)];
    let evs1 = vec![removed(h1)];
    let b0 = Batch::encode_for(&payload(&evs0), Some((&carriers, 0))).unwrap();
    let honest = Batch::encode_for(&payload(&evs1), Some((&carriers, 1))).unwrap();
    let mut bytes = honest.bytes().to_vec();
    let digest = crate::batch::SUMMED_FROM..crate::batch::HEADER_LEN;
    bytes[digest.clone()].copy_from_slice(&b0.bytes()[digest]);
    crate::testing::reseal(&mut bytes);
    let liar = Batch::from_vec(bytes).unwrap();
    assert!(liar.alike(&b0) && !honest.alike(&b0));
    assert!(!b0.carries(0) && !liar.carries(0));
    let mut m = merger(2, Rule::All, None, 1);
    m.add(0, Arc::new(b0)).unwrap();
    m.add(1, Arc::new(liar)).unwrap();
    let out = m.finish_step();
    assert_eq!(out.uncarried(), 0);
    // The general path: the two ranks share no event.
    assert!(out.is_empty());
    assert_eq!(m.stats().pending, 2);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]

    /// Leaving the carriers check to `finish_step` changes nothing a step
    /// publishes or counts, and refuses the same batches as `add` does
    /// (with one carrier an event: "all", and "quorum" with factor 1), some
    /// ranks' batches encoded for another world (carrying the wrong bytes).
    #[test]
    fn deferring_the_carriers_check_changes_nothing(
        steps in prop::collection::vec(step_reports(4), 1..6),
        identical in prop::collection::vec(any::<bool>(), 6),
        wrong in prop::collection::vec(prop::option::of(0usize..4), 6),
        quorum in any::<bool>(),
        pending in 0u64..3,
    ) {
        let (rule, factors) = if quorum {
            (Rule::Quorum, Some(vec![1, 1]))
        } else {
            (Rule::All, None)
        };
        let mut now = merger(4, rule, factors.clone(), pending);
        let mut later = merger(4, rule, factors, pending).with_deferred_carrier_check(true);
        let carriers = now.config().carriers.clone();
        let other = Carriers { world_size: 8, ..carriers.clone() };
        for (s, reports) in steps.iter().enumerate() {
            let mut refused = Vec::new();
            for r in 0..4 {
                if let Some(evs) = step_events(reports, if identical[s] { 0 } else { r }) {
                    let c = if wrong[s] == Some(r) { &other } else { &carriers };
                    let b = Arc::new(Batch::encode_for(&payload(&evs), Some((c, r))).unwrap());
                    if let Err(e) = now.add(r as i64, b.clone()) {
                        refused.push((r as i64, e));
                    }
                    later.add(r as i64, b).unwrap();
                }
            }
            let (x, y) = (now.finish_step(), later.finish_step());
            prop_assert_eq!(ids(&x), ids(&y), "step {}", s);
            prop_assert_eq!(x.payload(), y.payload());
            prop_assert_eq!(y.uncarried(), 0);
            prop_assert_eq!(now.stats(), later.stats(), "step {}", s);
            prop_assert_eq!(later.take_refused(), refused, "step {}", s);
        }
    }
}

/// The deferred check runs where the shortcut does not serve: a rank that
/// left out bytes it must carry is refused then, with `add`'s error, and
/// nothing of its batch stays.
#[test]
fn a_deferred_carriers_check_refuses_at_the_end_of_the_step() {
    let mut m = merger(2, Rule::All, None, 1).with_deferred_carrier_check(true);
    let carriers = m.config().carriers.clone();
    let wide = Carriers::new(4, Rule::All);
    let evs: Vec<Ev> = (1..=40).map(removed).collect();
    let good = Batch::encode_for(&payload(&evs), Some((&carriers, 1))).unwrap();
    let bad = Arc::new(Batch::encode_for(&payload(&evs), Some((&wide, 0))).unwrap());
    let mut strict = merger(2, Rule::All, None, 1);
    let Err(e) = strict.add(0, bad.clone()) else {
        panic!("rank 0 of 4 leaves out bytes rank 0 of 2 carries");
    };
    m.add(0, bad).unwrap();
    m.add(1, Arc::new(good)).unwrap();
    assert!(m.finish_step().is_empty());
    assert_eq!(m.take_refused(), vec![(0, e)]);
    assert!(m.take_refused().is_empty());
    let stats = m.stats();
    assert_eq!((stats.batches, stats.reports, stats.pending), (1, 40, 40));
}

/// A batch that claims (by a forged digest) to be alike one already taken
/// skips the group check; the groups its events really have, which no
/// factor covers, make no step panic, on the shortcut or the general path.
#[test]
fn a_digest_that_lies_about_groups_panics_nothing() {
    let a = batch(&[stored(1, Some(0))]);
    let mut bytes = batch(&[stored(1, Some(5))]).bytes().to_vec();
    let digest = crate::batch::SUMMED_FROM..crate::batch::HEADER_LEN;
    bytes[digest.clone()].copy_from_slice(&a.bytes()[digest]);
    crate::testing::reseal(&mut bytes);
    let liar = Arc::new(Batch::from_vec(bytes).unwrap());
    let mut strict = merger(3, Rule::Quorum, Some(vec![1]), 2);
    assert!(matches!(
        strict.add(1, liar.clone()),
        Err(Error::GroupOutOfRange { group: 5, .. })
    ));
    let mut m = merger(3, Rule::Quorum, Some(vec![1]), 2);
    m.add(0, Arc::new(a)).unwrap();
    m.add(1, liar).unwrap();
    // Rank 2 silent: the two batches wait whole; then it reports another
    // event, and the general path queues every report.
    m.finish_step();
    m.add(2, Arc::new(batch(&[removed(9)]))).unwrap();
    m.finish_step();
    m.finish_step();
    m.finish_step();
    let stats = m.stats();
    assert_eq!(
        stats.reports,
        stats.consumed + stats.cleared + stats.expired + stats.pending
    );
}
