//! Criterion benches of the core, per operation on the scheduler's and the
//! workers' paths:
//!
//! | group | what | throughput |
//! | --- | --- | --- |
//! | `encode/{int,bytes}` | msgspec payload -> batch: parse, check, XXH3-128 identities | events |
//! | `written/{int,bytes}` | events the worker wrote itself -> batch (`Batch::encode_written`: identities, carriers of rank 0 of 8, records; no parse) | events |
//! | `identity/{int,bytes}` | the fingerprint alone: `Identity::of` every event's bytes | events |
//! | `decode/{int,bytes}` | a received batch: `Batch::from_vec` (XXH3, records) and reading every event back with the schema reader | events |
//! | `merge_{all,quorum,any}[_skewed]/{int,bytes}/R_ranks` | R ranks' batches, as workers send them (each event's bytes only from its carriers), added; `finish_step_published` (what `finish_step_raw` reads: the events where they arrived, nothing copied) | events of all ranks |
//! | `straggler/{healthy,late}/8_ranks` | steady state, rule "all", two alternating step contents: every rank on time, or the last rank always one step late (its batch completes the others' pending reports of the step before) | events of all ranks |
//! | `{straggler,silent}/*_quorum/8_ranks` | the same under rule "quorum", factor 1 (vLLM's Mooncake child) | events of all ranks |
//! | `silent/{healthy,silent}/8_ranks` | the same, or the last rank silent, so a full window (`max_pending_steps` = 32) of the others' reports is pending and one step of them expires every step | events of all ranks |
//! | `raw/{int,bytes}` | the merged batch's output: each event's byte range (what `finish_step_raw` copies into a `bytes` per `msgspec.Raw`) | events |
//! | `gather/{int,bytes}` | a new batch of every other event (what `finish_step()` adds to build its output batch) | events |
//! | `guard/{off,on}/8_ranks/{1,16}_blocks` | rule "all", every rank on time, two alternating step contents of `BlockStored`s of 1 or 16 blocks (each the child of the one before) and as many `BlockRemoved`s of the other content's blocks, so every step's stream is valid; the guard off and on (docs/merge-rules.md, "Guard"), one iteration one step | events of all ranks |
//! | `guard/{off,on}/8_ranks/growing` | as above, but every step stores 8,192 new blocks (16-block events) and removes none, emptied every 64 steps: the guard holds up to half a million blocks, as a large tier | events of all ranks |
//!
//! Events look like the offloading connectors' (see `kvmerge bench`): block
//! size 16, 1-16 hashes per `BlockStored` (16 token ids per hash), 1 event in
//! 7 a `BlockRemoved`; int hashes (63-bit) or bytes hashes (32 bytes).
//! Building Python objects (`decode()`, `finish_step()`) needs the interpreter:
//! `benches/python_core.py` and `kvmerge bench` measure it.
//!
//! `cargo bench -p kvmerge-core` runs a short default grid (ranks 1 and 8,
//! 512 and 4,096 events per rank, int hashes for the merges); with
//! `KVMERGE_BENCH_FULL=1` the full grid: ranks 1, 2, 4, 8, 16, events per rank
//! 64, 512, 4,096, 65,536, int and bytes hashes everywhere.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use kvmerge_core::msgpack::{write_array_header, Reader};
use kvmerge_core::schema::read_event;
use kvmerge_core::testing::{clear, payload, write_stored_tail, write_str, write_uint, Ev};
use kvmerge_core::{Batch, Carriers, Identity, Merger, MergerConfig, Rule, Written};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Hashes {
    Int,
    Bytes,
}

impl Hashes {
    fn name(self) -> &'static str {
        match self {
            Hashes::Int => "int",
            Hashes::Bytes => "bytes",
        }
    }
}

struct Grid {
    ranks: Vec<usize>,
    sizes: Vec<usize>,
    /// Hash kinds for the per-batch groups (encode, identity, decode, output).
    hashes: Vec<Hashes>,
    /// Hash kinds for the merges (a merge reads identities, not hashes: the
    /// kind only changes the bytes its output copies).
    merge_hashes: Vec<Hashes>,
    full: bool,
}

fn grid() -> Grid {
    if std::env::var_os("KVMERGE_BENCH_FULL").is_some() {
        Grid {
            ranks: vec![1, 2, 4, 8, 16],
            sizes: vec![64, 512, 4096, 65536],
            hashes: vec![Hashes::Int, Hashes::Bytes],
            merge_hashes: vec![Hashes::Int, Hashes::Bytes],
            full: true,
        }
    } else {
        Grid {
            ranks: vec![1, 8],
            sizes: vec![512, 4096],
            hashes: vec![Hashes::Int, Hashes::Bytes],
            merge_hashes: vec![Hashes::Int],
            full: false,
        }
    }
}

// --- events, msgpack-encoded as msgspec encodes vLLM's classes ----------------

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn hash(out: &mut Vec<u8>, kind: Hashes, seed: u64) {
    match kind {
        Hashes::Int => write_uint(out, splitmix(seed) >> 1),
        Hashes::Bytes => {
            out.extend_from_slice(&[0xc4, 32]);
            for k in 0..4 {
                out.extend_from_slice(&splitmix(seed ^ (k << 56)).to_le_bytes());
            }
        }
    }
}

/// Event `i` of a rank's step: a `BlockStored` of 1-16 hashes (16 tokens
/// each, from a 128,256-token vocabulary) or, one in 7, a `BlockRemoved`.
fn event(i: u64, kind: Hashes, group: Option<u8>) -> Ev {
    let n = 1 + (splitmix(i) % 16);
    let mut e = Vec::with_capacity(64 + n as usize * 80);
    if i % 7 == 6 {
        e.push(0x83);
        write_str(&mut e, "type");
        write_str(&mut e, "BlockRemoved");
        write_str(&mut e, "block_hashes");
        write_array_header(&mut e, n as usize);
        for j in 0..n {
            hash(&mut e, kind, (i - 1) * 16 + j);
        }
        write_str(&mut e, "medium");
        write_str(&mut e, "CPU");
        return e;
    }
    e.push(0x80 | if group.is_some() { 9 } else { 8 });
    write_str(&mut e, "type");
    write_str(&mut e, "BlockStored");
    write_str(&mut e, "block_hashes");
    write_array_header(&mut e, n as usize);
    for j in 0..n {
        hash(&mut e, kind, i * 16 + j);
    }
    write_str(&mut e, "parent_block_hash");
    if i == 0 {
        e.push(0xc0);
    } else {
        hash(&mut e, kind, i * 16 - 1);
    }
    write_str(&mut e, "token_ids");
    write_array_header(&mut e, 16 * n as usize);
    for t in 0..16 * n {
        write_uint(&mut e, splitmix(i << 12 | t) % 128_256);
    }
    write_stored_tail(&mut e, group);
    e
}

fn events(n: usize, kind: Hashes) -> Vec<Ev> {
    events_from(0, n, kind)
}

/// `n` events starting at event `first` (another step's content).
fn events_from(first: u64, n: usize, kind: Hashes) -> Vec<Ev> {
    (first..first + n as u64)
        .map(|i| event(i, kind, Some(0)))
        .collect()
}

fn batch_of(evs: &[Ev]) -> Batch {
    Batch::encode(&payload(evs)).expect("bench events are well formed")
}

fn id(kind: Hashes, n: usize) -> BenchmarkId {
    BenchmarkId::new(kind.name(), n)
}

/// Very large inputs: fewer samples, or a full run takes hours.
fn sized(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, elements: usize) {
    if elements >= 1 << 18 {
        g.sample_size(10);
    } else {
        g.sample_size(30);
    }
}

// --- worker side ------------------------------------------------------------------

fn encode(c: &mut Criterion) {
    let grid = grid();
    let mut g = c.benchmark_group("encode");
    for &kind in &grid.hashes {
        for &n in &grid.sizes {
            let p = payload(&events(n, kind));
            sized(&mut g, n);
            g.throughput(Throughput::Elements(n as u64));
            g.bench_with_input(id(kind, n), &p, |b, p| {
                b.iter(|| Batch::encode(black_box(p)).unwrap())
            });
        }
    }
    g.finish();
}

/// What the worker's `kvmerge.encode` does in Rust after writing the events
/// (`Batch::encode_written`): identities, rank 0 of 8's carriers under rule
/// "all", records, and the carried events copied; no parse.
fn written(c: &mut Criterion) {
    let grid = grid();
    let carriers = Carriers::new(8, Rule::All);
    let mut g = c.benchmark_group("written");
    for &kind in &grid.hashes {
        for &n in &grid.sizes {
            let mut bytes = Vec::new();
            let mut ends = Vec::new();
            for e in events(n, kind) {
                bytes.extend_from_slice(&e);
                let info = read_event(&mut Reader::new(&e)).expect("bench events are well formed");
                ends.push(Written {
                    end: bytes.len(),
                    info,
                });
            }
            sized(&mut g, n);
            g.throughput(Throughput::Elements(n as u64));
            g.bench_with_input(id(kind, n), &(bytes, ends), |b, (bytes, ends)| {
                b.iter(|| {
                    Batch::encode_written(black_box(bytes), black_box(ends), Some((&carriers, 0)))
                        .unwrap()
                })
            });
        }
    }
    g.finish();
}

fn identity(c: &mut Criterion) {
    let grid = grid();
    let mut g = c.benchmark_group("identity");
    for &kind in &grid.hashes {
        for &n in &grid.sizes {
            let evs = events(n, kind);
            sized(&mut g, n);
            g.throughput(Throughput::Elements(n as u64));
            g.bench_with_input(id(kind, n), &evs, |b, evs| {
                b.iter(|| {
                    evs.iter()
                        .map(|e| Identity::of(black_box(e)).0[0])
                        .fold(0u8, |a, x| a ^ x)
                })
            });
        }
    }
    g.finish();
}

// --- scheduler side ---------------------------------------------------------------

fn decode(c: &mut Criterion) {
    let grid = grid();
    let mut g = c.benchmark_group("decode");
    for &kind in &grid.hashes {
        for &n in &grid.sizes {
            let bytes = batch_of(&events(n, kind)).bytes().to_vec();
            sized(&mut g, n);
            g.throughput(Throughput::Elements(n as u64));
            g.bench_with_input(id(kind, n), &bytes, |b, bytes| {
                b.iter_batched(
                    || bytes.clone(),
                    |v| {
                        let batch = Batch::from_vec(black_box(v)).unwrap();
                        let mut r = Reader::new(batch.payload());
                        let n = r.read_array_len().unwrap();
                        let mut stores = 0usize;
                        for _ in 0..n {
                            let info = read_event(&mut r).unwrap();
                            stores += info.group_idx.is_some() as usize;
                        }
                        stores
                    },
                    BatchSize::LargeInput,
                )
            });
        }
    }
    g.finish();
}

/// Per-rank batches for one step, each encoded for its rank of `carriers`
/// (without the bytes other ranks carry). `skew` drops every 10th event on
/// the last rank and adds a clear to every rank, forcing the general merge
/// path.
fn step_batches(carriers: &Carriers, n: usize, kind: Hashes, skew: bool) -> Vec<Arc<Batch>> {
    let ranks = carriers.world_size;
    let base = events(n, kind);
    (0..ranks)
        .map(|r| {
            let mut evs: Vec<Ev> = if skew && r == ranks - 1 {
                base.iter()
                    .enumerate()
                    .filter(|(i, _)| i % 10 != 3)
                    .map(|(_, e)| e.clone())
                    .collect()
            } else {
                base.clone()
            };
            if skew {
                evs.insert(evs.len() / 2, clear());
            }
            // One batch per rank, as the ranks' workers would send them.
            Arc::new(Batch::encode_for(&payload(&evs), Some((carriers, r))).expect("valid events"))
        })
        .collect()
}

fn merge(c: &mut Criterion) {
    let grid = grid();
    for (name, rule, skew) in [
        ("merge_all", Rule::All, false),
        ("merge_all_skewed", Rule::All, true),
        ("merge_quorum", Rule::Quorum, false),
        ("merge_quorum_skewed", Rule::Quorum, true),
        ("merge_any", Rule::Any, false),
        ("merge_any_skewed", Rule::Any, true),
    ] {
        let mut g = c.benchmark_group(name);
        if grid.full {
            g.warm_up_time(Duration::from_secs(1));
            g.measurement_time(Duration::from_secs(2));
        }
        for &kind in &grid.merge_hashes {
            for &w in &grid.ranks {
                for &n in &grid.sizes {
                    let mut cfg = MergerConfig::new(w, rule);
                    if rule == Rule::Quorum {
                        cfg.carriers.replication_factors = Some(vec![1]);
                    }
                    let batches = step_batches(&cfg.carriers, n, kind, skew);
                    let mut m = Merger::new(cfg).unwrap();
                    sized(&mut g, w * n);
                    g.throughput(Throughput::Elements((w * n) as u64));
                    let bench_id = BenchmarkId::new(format!("{}/{w}_ranks", kind.name()), n);
                    g.bench_function(bench_id, |b| {
                        b.iter(|| {
                            for (r, batch) in batches.iter().enumerate() {
                                m.add(r as i64, batch.clone()).unwrap();
                            }
                            black_box(m.finish_step_published())
                        })
                    });
                }
            }
        }
        g.finish();
    }
}

/// What a rank does in one step of the straggler benches.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Last {
    /// The last rank reports on time, as every other rank.
    OnTime,
    /// The last rank reports the step before's events (one step late).
    Late,
    /// The last rank reports nothing.
    Silent,
}

/// Steady state of `rule` ("all", or "quorum" with factor 1) at `w` ranks and `n` events per rank: two
/// alternating step contents, the last rank as `last` says. One iteration is
/// one step: the ranks' batches (moved into the merger, so `iter_batched`)
/// added, then `finish_step_published`; its throughput counted in
/// `elements` a step.
fn bench_steady(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    w: usize,
    n: usize,
    last: Last,
    rule: Rule,
    elements: u64,
) {
    let mut cfg = MergerConfig::new(w, rule);
    cfg.carriers.replication_factors = (rule == Rule::Quorum).then(|| vec![1]);
    // Per content (even and odd steps), each rank's batch as its worker sends it.
    let contents: Vec<Vec<Arc<Batch>>> = (0..2u64)
        .map(|k| {
            let p = payload(&events_from(k * 1_000_003, n, Hashes::Int));
            (0..w)
                .map(|r| {
                    let batch = Batch::encode_for(&p, Some((&cfg.carriers, r)));
                    Arc::new(batch.expect("valid events"))
                })
                .collect()
        })
        .collect();
    let step_input = |s: u64| -> Vec<(i64, Arc<Batch>)> {
        (0..w)
            .filter_map(|r| {
                let c = if r == w - 1 && last == Last::Late {
                    s.wrapping_sub(1)
                } else {
                    s
                };
                let skip = r == w - 1 && (last == Last::Silent || (last == Last::Late && s == 0));
                (!skip).then(|| (r as i64, contents[(c % 2) as usize][r].clone()))
            })
            .collect()
    };
    // As the scheduler's step makes it: the carriers check deferred.
    let mut m = Merger::new(cfg.clone())
        .unwrap()
        .with_deferred_carrier_check(true);
    // Fill the window first: the silent case is measured with a full one.
    let mut s = 0u64;
    while s < 2 * cfg.max_pending_steps + 2 {
        m.add_all(step_input(s)).unwrap();
        black_box(m.finish_step_published());
        s += 1;
    }
    let expect = match last {
        Last::Silent => cfg.max_pending_steps * ((w - 1) * n) as u64,
        Last::Late => ((w - 1) * n) as u64,
        Last::OnTime => 0,
    };
    assert_eq!(m.stats().pending, expect, "steady state");
    g.throughput(Throughput::Elements(elements));
    // Inputs are made in order, then consumed in that order: the step
    // counter of the setup follows the merger's.
    let mut next = s;
    g.bench_function(BenchmarkId::new(format!("{name}/{w}_ranks"), n), |b| {
        b.iter_batched(
            || {
                let input = step_input(next);
                next += 1;
                input
            },
            |input| {
                m.add_all(black_box(input)).unwrap();
                black_box(m.finish_step_published())
            },
            BatchSize::SmallInput,
        )
    });
}

/// Stragglers: the same steady state with the last rank one step late
/// (`straggler`) or silent (`silent`), next to all ranks on time (`healthy`)
/// in the same group, so one run gives the ratio.
fn stragglers(c: &mut Criterion) {
    for (group, name, last) in [
        ("straggler", "late", Last::Late),
        ("silent", "silent", Last::Silent),
    ] {
        let mut g = c.benchmark_group(group);
        g.sample_size(30);
        for n in [32, 512] {
            let reports = 8 * n as u64;
            bench_steady(&mut g, "healthy", 8, n, Last::OnTime, Rule::All, reports);
            bench_steady(&mut g, name, 8, n, last, Rule::All, reports);
            // Rule "quorum" (factor 1), as vLLM's Mooncake child.
            let quorum = Rule::Quorum;
            bench_steady(
                &mut g,
                "healthy_quorum",
                8,
                n,
                Last::OnTime,
                quorum,
                reports,
            );
            bench_steady(
                &mut g,
                &format!("{name}_quorum"),
                8,
                n,
                last,
                quorum,
                reports,
            );
        }
        g.finish();
    }
}

/// A step's cost as a function of the ranks (issue 37): every rank on
/// time (healthy: one digest comparison per rank, then one rank's events)
/// and the last rank a step late, TP 2 to 16, under "all" and "quorum"
/// (factor 1). Throughput in the events a step publishes, so a healthy
/// step's is flat in the ranks where its cost is.
fn ranks(c: &mut Criterion) {
    let mut g = c.benchmark_group("ranks");
    g.sample_size(30);
    for n in [32, 512] {
        for w in [2, 4, 8, 16] {
            for (rule, suffix) in [(Rule::All, ""), (Rule::Quorum, "_quorum")] {
                for (last, name) in [(Last::OnTime, "healthy"), (Last::Late, "late")] {
                    let name = format!("{name}{suffix}");
                    bench_steady(&mut g, &name, w, n, last, rule, n as u64);
                }
            }
        }
    }
    g.finish();
}

/// A `BlockStored` of blocks `blocks` (16 token ids each), the child of
/// `parent`, as the offloading connectors report them (the Mooncake store
/// one block at a time).
fn stored(blocks: std::ops::Range<u64>, parent: Option<u64>) -> Ev {
    let mut e = vec![0x88];
    write_str(&mut e, "type");
    write_str(&mut e, "BlockStored");
    write_str(&mut e, "block_hashes");
    write_array_header(&mut e, blocks.clone().count());
    blocks.clone().for_each(|b| hash(&mut e, Hashes::Int, b));
    write_str(&mut e, "parent_block_hash");
    match parent {
        Some(p) => hash(&mut e, Hashes::Int, p),
        None => e.push(0xc0),
    }
    write_str(&mut e, "token_ids");
    write_array_header(&mut e, 16 * blocks.clone().count());
    for b in blocks {
        for t in 0..16 {
            write_uint(&mut e, splitmix(b << 4 | t) % 128_256);
        }
    }
    write_stored_tail(&mut e, None);
    e
}

fn removed(blocks: std::ops::Range<u64>) -> Ev {
    let mut e = vec![0x83];
    write_str(&mut e, "type");
    write_str(&mut e, "BlockRemoved");
    write_str(&mut e, "block_hashes");
    write_array_header(&mut e, blocks.clone().count());
    blocks.for_each(|b| hash(&mut e, Hashes::Int, b));
    write_str(&mut e, "medium");
    write_str(&mut e, "CPU");
    e
}

/// The guard's cost: `finish_step_published` of the same steps without and
/// with it, for events of 1 and of 16 blocks. Content k removes the other
/// content's `n / 2` events' blocks, then stores its own as one chain:
/// after the first step nothing is withheld, so the guard reads, checks
/// and records every published event.
fn guard(c: &mut Criterion) {
    let (w, n) = (8, 512);
    let half = n as u64 / 2;
    let cfg = MergerConfig::new(w, Rule::All);
    let mut g = c.benchmark_group("guard");
    g.sample_size(30);
    g.throughput(Throughput::Elements((w * n) as u64));
    for k in [1u64, 16] {
        let contents: Vec<Vec<Arc<Batch>>> = (0..2u64)
            .map(|c| {
                let (own, other) = (c * half * k, (1 - c) * half * k);
                let events =
                    |first: u64| (0..half).map(move |e| first + e * k..first + (e + 1) * k);
                let mut evs: Vec<Ev> = events(other).map(removed).collect();
                evs.extend(
                    events(own).map(|b| stored(b.clone(), (b.start > own).then(|| b.start - 1))),
                );
                let p = payload(&evs);
                (0..w)
                    .map(|r| {
                        Arc::new(
                            Batch::encode_for(&p, Some((&cfg.carriers, r))).expect("valid events"),
                        )
                    })
                    .collect()
            })
            .collect();
        for on in [false, true] {
            let mut m = Merger::new(cfg.clone()).unwrap().with_guard(on);
            let mut step = 0usize;
            let mut run = |m: &mut Merger| {
                for (r, batch) in contents[step % 2].iter().enumerate() {
                    m.add(r as i64, batch.clone()).unwrap();
                }
                step += 1;
                black_box(m.finish_step_published().len())
            };
            run(&mut m);
            run(&mut m);
            let before = m.stats().withheld();
            assert_eq!(run(&mut m), n, "a valid stream: nothing withheld");
            let name = if on { "on" } else { "off" };
            g.bench_function(
                BenchmarkId::new(format!("{name}/{w}_ranks/{k}_blocks"), n),
                |b| b.iter(|| run(&mut m)),
            );
            assert_eq!(m.stats().withheld(), before, "steady state");
        }
    }
    // A tier that only grows (every step stores 8,192 new blocks, in
    // 16-block events; emptied every 64 steps): the guard's sets reach
    // half a million blocks, so most lookups miss the cache, as in a large
    // CPU or disk tier.
    let steps = 64;
    let contents: Vec<Vec<Arc<Batch>>> = (0..steps as u64)
        .map(|c| {
            let own = c * n as u64 * 16;
            let evs: Vec<Ev> = (0..n as u64)
                .map(|e| {
                    let b = own + e * 16..own + (e + 1) * 16;
                    stored(b.clone(), (e > 0).then(|| b.start - 1))
                })
                .collect();
            let p = payload(&evs);
            (0..w)
                .map(|r| {
                    Arc::new(Batch::encode_for(&p, Some((&cfg.carriers, r))).expect("valid events"))
                })
                .collect()
        })
        .collect();
    for on in [false, true] {
        let mut m = Merger::new(cfg.clone()).unwrap().with_guard(on);
        let mut step = 0usize;
        let name = if on { "on" } else { "off" };
        g.bench_function(
            BenchmarkId::new(format!("{name}/{w}_ranks/growing"), n),
            |b| {
                b.iter(|| {
                    if step % steps == 0 {
                        m.reset();
                    }
                    for (r, batch) in contents[step % steps].iter().enumerate() {
                        m.add(r as i64, batch.clone()).unwrap();
                    }
                    step += 1;
                    black_box(m.finish_step_published().len())
                })
            },
        );
    }
    g.finish();
}

fn raw(c: &mut Criterion) {
    let grid = grid();
    let mut g = c.benchmark_group("raw");
    for &kind in &grid.hashes {
        for &n in &grid.sizes {
            let batch = batch_of(&events(n, kind));
            sized(&mut g, n);
            g.throughput(Throughput::Elements(n as u64));
            g.bench_with_input(id(kind, n), &batch, |b, batch| {
                b.iter(|| {
                    let bytes = batch.bytes();
                    (0..batch.len())
                        .map(|i| {
                            let r = batch.event_range(black_box(i)).expect("carried");
                            bytes[r.start] as usize + r.len()
                        })
                        .sum::<usize>()
                })
            });
        }
    }
    g.finish();
}

fn gather(c: &mut Criterion) {
    let grid = grid();
    let mut g = c.benchmark_group("gather");
    for &kind in &grid.hashes {
        for &n in &grid.sizes {
            let batch = batch_of(&events(n, kind));
            sized(&mut g, n);
            g.throughput(Throughput::Elements(n as u64 / 2));
            g.bench_with_input(id(kind, n), &batch, |b, batch| {
                b.iter(|| Batch::gather((0..batch.len()).step_by(2).map(|i| (black_box(batch), i))))
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));
    targets = encode, written, identity, decode, merge, stragglers, ranks, guard, raw, gather
}
criterion_main!(benches);
