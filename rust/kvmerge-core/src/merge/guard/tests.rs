use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;

use crate::merge::{Merger, MergerConfig, Stats};
use crate::rule::Rule;
use crate::schema::{read_blocks, BlockHash, EventKind};
use crate::testing::{batch, clear, removed_blocks, stored_blocks, stored_blocks_in, Ev};
use crate::{Batch, Identity};

const A: BlockHash = BlockHash::Int(1);
const B: BlockHash = BlockHash::Int(2);
const C: BlockHash = BlockHash::Bytes(b"c");

fn st(hashes: &[BlockHash], parent: Option<BlockHash>) -> Ev {
    stored_blocks(hashes, parent, Some("CPU"))
}

fn rm(hashes: &[BlockHash]) -> Ev {
    removed_blocks(hashes, Some("CPU"))
}

fn guarded(w: usize, rule: Rule, factors: Option<Vec<u32>>) -> Merger {
    let mut cfg = MergerConfig::new(w, rule);
    cfg.carriers.replication_factors = factors;
    cfg.max_pending_steps = 2;
    Merger::new(cfg).unwrap().with_guard(true)
}

fn ids(b: &Batch) -> Vec<Identity> {
    b.identities().collect()
}

fn ids_of(events: &[Ev]) -> Vec<Identity> {
    events.iter().map(|e| Identity::of(e)).collect()
}

/// One step of a one-rank merger: what it publishes of `events`.
fn step(m: &mut Merger, events: &[Ev]) -> Vec<Identity> {
    m.add(0, Arc::new(batch(events))).unwrap();
    ids(&m.finish_step())
}

fn withheld(s: Stats) -> (u64, u64, u64) {
    (s.withheld_orphan, s.withheld_duplicate, s.withheld_unknown)
}

fn check_counters(s: Stats) {
    assert_eq!(s.reports, s.consumed + s.cleared + s.expired + s.pending);
}

#[test]
fn a_store_whose_parent_is_not_held_is_withheld() {
    let mut m = guarded(1, Rule::All, None);
    assert!(step(&mut m, &[st(&[B], Some(A))]).is_empty());
    assert_eq!(withheld(m.stats()), (1, 0, 0));
    let ok = [st(&[A], None), st(&[B], Some(A))];
    assert_eq!(step(&mut m, &ok), ids_of(&ok));
    let s = m.stats();
    assert_eq!((s.published, s.withheld()), (2, 1));
    check_counters(s);
}

#[test]
fn a_store_of_a_held_block_is_withheld() {
    let mut m = guarded(1, Rule::All, None);
    assert_eq!(step(&mut m, &[st(&[A], None)]), ids_of(&[st(&[A], None)]));
    // Again, in another event (another parent), or twice in one event.
    let again = [st(&[A], None), st(&[B, A], None), st(&[C, C], None)];
    assert!(step(&mut m, &again).is_empty());
    assert_eq!(withheld(m.stats()), (0, 3, 0));
    // A withheld store held nothing: B and C are still new.
    let fine = [st(&[B, C], Some(A))];
    assert_eq!(step(&mut m, &fine), ids_of(&fine));
}

#[test]
fn a_removal_of_a_block_not_held_is_withheld() {
    let mut m = guarded(1, Rule::All, None);
    let seq = [
        rm(&[A]),
        st(&[A, B], None),
        rm(&[A, A]),
        rm(&[A, C]),
        rm(&[B, A]),
        rm(&[A]),
    ];
    let out = step(&mut m, &seq);
    assert_eq!(out, ids_of(&[seq[1].clone(), seq[4].clone()]));
    assert_eq!(withheld(m.stats()), (0, 0, 4));
    check_counters(m.stats());
}

#[test]
fn a_clear_empties_every_medium() {
    let mut m = guarded(1, Rule::All, None);
    let gpu = stored_blocks(&[A], None, Some("GPU"));
    let seq = [st(&[A], None), gpu.clone(), clear(), rm(&[A])];
    let out = step(&mut m, &seq);
    assert_eq!(out, ids_of(&seq[..3]));
    assert_eq!(
        step(&mut m, std::slice::from_ref(&gpu)),
        ids_of(std::slice::from_ref(&gpu))
    );
    assert_eq!(withheld(m.stats()), (0, 0, 1));
}

#[test]
fn reset_empties_every_medium() {
    let mut m = guarded(1, Rule::All, None);
    step(&mut m, &[st(&[A], None)]);
    m.reset();
    assert_eq!(step(&mut m, &[st(&[A], None)]), ids_of(&[st(&[A], None)]));
    assert_eq!(m.stats().withheld(), 0);
}

#[test]
fn each_medium_holds_its_own_blocks() {
    let mut m = guarded(1, Rule::All, None);
    let cpu = st(&[A], None);
    let gpu = stored_blocks(&[A], None, Some("GPU"));
    let none = stored_blocks(&[A], None, None);
    let seq = [
        cpu.clone(),
        gpu.clone(),
        none.clone(),
        removed_blocks(&[A], Some("GPU")),
        stored_blocks(&[B], Some(A), Some("GPU")),
        removed_blocks(&[B], None),
        stored_blocks(&[B], Some(A), None),
    ];
    let out = step(&mut m, &seq);
    let want = [&seq[0], &seq[1], &seq[2], &seq[3], &seq[6]];
    assert_eq!(out, want.map(|e| Identity::of(e)).to_vec());
    assert_eq!(withheld(m.stats()), (1, 0, 1));
}

#[test]
fn an_int_and_a_bytes_are_different_hashes() {
    let mut m = guarded(1, Rule::All, None);
    let hashes = [
        BlockHash::Int(0),
        BlockHash::Bytes(b""),
        BlockHash::Bytes(&[0]),
        BlockHash::Int(1),
        BlockHash::Bytes(&[1]),
        BlockHash::Int(-1),
        BlockHash::Int(u64::MAX as i128),
        BlockHash::Int(i64::MIN as i128),
        BlockHash::Bytes(&[0xff; 8]),
    ];
    let seq: Vec<Ev> = hashes.iter().map(|&h| st(&[h], None)).collect();
    assert_eq!(step(&mut m, &seq), ids_of(&seq));
    let gone: Vec<Ev> = hashes.iter().rev().map(|&h| rm(&[h])).collect();
    assert_eq!(step(&mut m, &gone), ids_of(&gone));
    assert_eq!(m.stats().withheld(), 0);
}

/// Under "quorum" at world 2, factor 2, a store completes with one rank,
/// a removal needs both. A rank a step late re-publishes a store the other
/// completed, and its store of a child after its parent's removal is
/// published after that removal: the guard withholds both.
#[test]
fn quorum_republishes_what_the_guard_withholds() {
    let a = stored_blocks_in(&[A], None, Some("CPU"), Some(0));
    let b = stored_blocks_in(&[B], Some(A), Some("CPU"), Some(0));
    let run = |m: &mut Merger| -> Vec<Vec<Identity>> {
        m.add(0, Arc::new(batch(&[a.clone(), rm(&[A])]))).unwrap();
        m.add(1, Arc::new(Batch::empty())).unwrap();
        let first = ids(&m.finish_step());
        m.add(0, Arc::new(Batch::empty())).unwrap();
        m.add(1, Arc::new(batch(&[a.clone(), rm(&[A]), b.clone()])))
            .unwrap();
        vec![first, ids(&m.finish_step())]
    };
    let mut cfg = MergerConfig::new(2, Rule::Quorum);
    cfg.carriers.replication_factors = Some(vec![2]);
    let mut plain = Merger::new(cfg).unwrap();
    let mut m = guarded(2, Rule::Quorum, Some(vec![2]));
    assert_eq!(
        run(&mut plain),
        vec![
            ids_of(std::slice::from_ref(&a)),
            ids_of(&[a.clone(), rm(&[A]), b.clone()])
        ],
    );
    assert_eq!(run(&mut m), vec![ids_of(&[a]), ids_of(&[rm(&[A])])]);
    assert_eq!(withheld(m.stats()), (1, 1, 0));
    check_counters(m.stats());
    assert_eq!(plain.stats().consumed, m.stats().consumed);
    assert_eq!(plain.stats().published, m.stats().published + 2);
}

#[test]
fn without_a_guard_nothing_is_withheld() {
    let mut m = Merger::new(MergerConfig::new(1, Rule::All)).unwrap();
    assert!(!m.guarded());
    let seq = [rm(&[A]), st(&[B], Some(A)), st(&[C, C], None)];
    assert_eq!(step(&mut m, &seq), ids_of(&seq));
    assert_eq!(m.stats().withheld(), 0);
    assert!(m.with_guard(true).guarded());
}

/// One event of the test universe, as the model sees it.
#[derive(Debug, Clone)]
enum Model {
    Stored(Vec<u8>, Option<u8>, Option<&'static str>),
    Removed(Vec<u8>, Option<&'static str>),
    Clear,
}

/// Hash `h` of the universe: ints for even `h`, bytes for odd, so an int
/// and a bytes of the same value meet too.
fn hash_of(h: u8) -> BlockHash<'static> {
    const BYTES: [&[u8]; 8] = [
        b"\x00", b"\x01", b"\x02", b"\x03", b"\x04", b"\x05", b"\x06", b"\x07",
    ];
    if h % 2 == 0 {
        BlockHash::Int((h / 2) as i128)
    } else {
        BlockHash::Bytes(BYTES[(h / 2) as usize])
    }
}

fn encode(e: &Model) -> Ev {
    let hashes = |hs: &[u8]| hs.iter().map(|&h| hash_of(h)).collect::<Vec<_>>();
    match e {
        Model::Stored(hs, parent, medium) => {
            stored_blocks(&hashes(hs), parent.map(hash_of), *medium)
        }
        Model::Removed(hs, medium) => removed_blocks(&hashes(hs), *medium),
        Model::Clear => clear(),
    }
}

fn model_event() -> impl Strategy<Value = Model> {
    let hashes = || prop::collection::vec(0u8..6, 0..3);
    let medium = || prop_oneof![Just(None), Just(Some("CPU")), Just(Some("GPU"))];
    prop_oneof![
        4 => (hashes(), prop::option::of(0u8..6), medium()).prop_map(|(h, p, m)| Model::Stored(h, p, m)),
        3 => (hashes(), medium()).prop_map(|(h, m)| Model::Removed(h, m)),
        1 => Just(Model::Clear),
    ]
}

/// The guard, naively: which of `published` a router can apply, in turn.
fn model_guard(held: &mut HashMap<Option<&'static str>, Vec<u8>>, e: &Model) -> Option<usize> {
    match e {
        Model::Clear => {
            held.clear();
            None
        }
        Model::Stored(hs, parent, m) => {
            let set = held.entry(*m).or_default();
            if parent.is_some_and(|p| !set.contains(&p)) {
                return Some(0);
            }
            let twice = hs.iter().enumerate().any(|(i, h)| hs[..i].contains(h));
            if twice || hs.iter().any(|h| set.contains(h)) {
                return Some(1);
            }
            set.extend(hs);
            None
        }
        Model::Removed(hs, m) => {
            let set = held.entry(*m).or_default();
            let twice = hs.iter().enumerate().any(|(i, h)| hs[..i].contains(h));
            if twice || hs.iter().any(|h| !set.contains(h)) {
                return Some(2);
            }
            set.retain(|h| !hs.contains(h));
            None
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the ranks report, under every rule: the guarded merger
    /// publishes what the unguarded one does, less what a naive guard
    /// withholds, with the same reports consumed, and the reasons counted.
    #[test]
    fn the_guard_is_a_filter_on_the_rule(
        pool in prop::collection::vec(model_event(), 1..8),
        steps in prop::collection::vec(
            prop::collection::vec(prop::option::weighted(0.85, prop::collection::vec(0usize..8, 0..6)), 3..=3),
            1..8,
        ),
        rule in prop_oneof![Just(Rule::All), Just(Rule::Quorum), Just(Rule::Any)],
        resets in prop::collection::vec(any::<bool>(), 8),
    ) {
        let factors = (rule == Rule::Quorum).then(|| vec![2]);
        let mut cfg = MergerConfig::new(3, rule);
        cfg.carriers.replication_factors = factors;
        cfg.max_pending_steps = 1;
        let mut plain = Merger::new(cfg.clone()).unwrap();
        let mut m = Merger::new(cfg).unwrap().with_guard(true);
        let encoded: Vec<Ev> = pool.iter().map(encode).collect();
        let by_id: HashMap<Identity, &Model> =
            encoded.iter().zip(&pool).map(|(e, p)| (Identity::of(e), p)).collect();
        let mut held = HashMap::new();
        let mut counts = [0u64; 3];
        for (s, reports) in steps.iter().enumerate() {
            for (r, picks) in reports.iter().enumerate() {
                if let Some(picks) = picks {
                    let evs: Vec<Ev> = picks.iter().map(|&i| encoded[i % encoded.len()].clone()).collect();
                    let b = Arc::new(batch(&evs));
                    plain.add(r as i64, b.clone()).unwrap();
                    m.add(r as i64, b).unwrap();
                }
            }
            let mut want = Vec::new();
            for id in ids(&plain.finish_step()) {
                match model_guard(&mut held, by_id[&id]) {
                    Some(why) => counts[why] += 1,
                    None => want.push(id),
                }
            }
            prop_assert_eq!(ids(&m.finish_step()), want);
            let (a, b) = (plain.stats(), m.stats());
            prop_assert_eq!(withheld(b), (counts[0], counts[1], counts[2]));
            prop_assert_eq!(b.published + b.withheld(), a.published);
            prop_assert_eq!((a.consumed, a.cleared, a.expired, a.pending), (b.consumed, b.cleared, b.expired, b.pending));
            if resets[s] {
                plain.reset();
                m.reset();
                held.clear();
            }
        }
    }
}

proptest! {
    /// Bytes of any shape read as blocks or as None, never a panic, where
    /// ever `tokens_end` points and whatever the kind; an event reads the
    /// same jumping over its token ids as reading them; cut short before
    /// its medium, its blocks do not read; the fields after it are not read.
    #[test]
    fn blocks_of_any_bytes_never_panic(
        bytes in prop::collection::vec(any::<u8>(), 0..64),
        anywhere in any::<u32>(),
        cut in any::<prop::sample::Index>(),
    ) {
        for kind in [EventKind::BlockStored, EventKind::BlockRemoved] {
            let _ = read_blocks(&bytes, kind, anywhere, drop);
            let _ = read_blocks(&bytes, kind, anywhere % 64, drop);
        }
        let e = stored_blocks(&[A, C], Some(B), Some("CPU"));
        let info = crate::schema::read_event(&mut crate::msgpack::Reader::new(&e)).unwrap();
        prop_assert!(info.tokens_end > 0);
        let medium_end = e.windows(3).position(|w| w == b"CPU").unwrap() + 3;
        prop_assert!(medium_end < e.len(), "fields follow the medium");
        for tokens_end in [0, info.tokens_end] {
            let mut hashes = vec![];
            let blocks =
                read_blocks(&e, EventKind::BlockStored, tokens_end, |h| hashes.push(h)).unwrap();
            prop_assert_eq!(hashes, vec![A, C]);
            prop_assert_eq!((blocks.parent, blocks.medium), (Some(B), Some(&b"CPU"[..])));
            let short = &e[..cut.index(medium_end)];
            prop_assert!(read_blocks(short, EventKind::BlockStored, tokens_end, drop).is_none());
            let head = read_blocks(&e[..medium_end], EventKind::BlockStored, tokens_end, drop);
            prop_assert_eq!(head.map(|b| (b.parent, b.medium)), Some((blocks.parent, blocks.medium)));
        }
    }
}

/// A forged batch (its checksum recomputed) whose event does not read as
/// blocks: published as the rule says, nothing withheld, no panic.
#[test]
fn an_event_that_does_not_read_is_published_unchanged() {
    let mut bytes = batch(&[rm(&[A])]).bytes().to_vec();
    let at = bytes
        .windows(12)
        .position(|w| w == b"block_hashes")
        .expect("the key is there");
    bytes[at] = b'x';
    crate::testing::reseal(&mut bytes);
    let forged = Arc::new(Batch::from_vec(bytes).unwrap());
    let mut m = guarded(1, Rule::All, None);
    m.add(0, forged.clone()).unwrap();
    assert_eq!(ids(&m.finish_step()), ids(&forged));
    assert_eq!(m.stats().withheld(), 0);
}
