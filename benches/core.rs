//! Criterion benches of the core: encode, identity, validation of a received
//! batch, merge per rule, and gathering the output.
//!
//! `cargo bench -p kvmerge-core` runs the default grid (it includes the
//! target case, 8 ranks x 4,096 events); `KVMERGE_BENCH_FULL=1` runs ranks
//! 1-16 x events 64-65,536.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use kvmerge_core::testing::{clear, payload, removed, stored_with, Ev};
use kvmerge_core::{Batch, Identity, Merger, MergerConfig, Rule};

/// One rank's events for a step: stores of ~8 hashes and 128 tokens, ~15%
/// removals, as the workload describes.
fn events(n: usize, salt: u64) -> Vec<Ev> {
    (0..n as u64)
        .map(|i| match i % 7 {
            6 => removed((i % 120) as u8),
            _ => stored_with(i ^ salt, Some(0), 8, 128),
        })
        .collect()
}

fn grid() -> (Vec<usize>, Vec<usize>) {
    if std::env::var_os("KVMERGE_BENCH_FULL").is_some() {
        (vec![1, 2, 4, 8, 16], vec![64, 512, 4096, 65536])
    } else {
        (vec![1, 8], vec![512, 4096])
    }
}

fn encode(c: &mut Criterion) {
    let mut g = c.benchmark_group("encode");
    for n in grid().1 {
        let p = payload(&events(n, 0));
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &p, |b, p| {
            b.iter(|| Batch::encode(black_box(p)).unwrap())
        });
    }
    g.finish();
}

fn identity(c: &mut Criterion) {
    let mut g = c.benchmark_group("identity");
    let ev = stored_with(7, Some(0), 8, 128);
    g.throughput(Throughput::Bytes(ev.len() as u64));
    g.bench_function("one_event", |b| b.iter(|| Identity::of(black_box(&ev))));
    g.finish();
}

fn receive(c: &mut Criterion) {
    let mut g = c.benchmark_group("receive");
    for n in grid().1 {
        let bytes = Batch::encode(&payload(&events(n, 0)))
            .unwrap()
            .bytes()
            .to_vec();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &bytes, |b, bytes| {
            b.iter_batched(
                || bytes.clone(),
                |v| Batch::from_vec(black_box(v)).unwrap(),
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

/// Per-rank batches for one step. `skew` drops every 10th event on the last
/// rank and adds a clear, forcing the general (non-identical) path.
fn step_batches(ranks: usize, n: usize, skew: bool) -> Vec<Arc<Batch>> {
    (0..ranks)
        .map(|r| {
            let mut evs = events(n, 0);
            if skew && r == ranks - 1 {
                evs = evs
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| i % 10 != 3)
                    .map(|(_, e)| e)
                    .collect();
            }
            if skew {
                evs.insert(evs.len() / 2, clear());
            }
            Arc::new(Batch::encode(&payload(&evs)).unwrap())
        })
        .collect()
}

fn merge(c: &mut Criterion) {
    let (ranks, sizes) = grid();
    for (name, rule, skew) in [
        ("merge_all", Rule::All, false),
        ("merge_all_skewed", Rule::All, true),
        ("merge_quorum", Rule::Quorum, false),
        ("merge_quorum_skewed", Rule::Quorum, true),
        ("merge_any", Rule::Any, false),
        ("merge_any_skewed", Rule::Any, true),
    ] {
        let mut g = c.benchmark_group(name);
        g.measurement_time(Duration::from_secs(3));
        for &w in &ranks {
            for &n in &sizes {
                let batches = step_batches(w, n, skew);
                let mut cfg = MergerConfig::new(w, rule);
                if rule == Rule::Quorum {
                    cfg.replication_factors = Some(vec![1]);
                }
                let mut m = Merger::new(cfg).unwrap();
                g.throughput(Throughput::Elements((w * n) as u64));
                g.bench_function(BenchmarkId::new(format!("{w}_ranks"), n), |b| {
                    b.iter(|| {
                        for (r, batch) in batches.iter().enumerate() {
                            m.add(r as i64, batch.clone()).unwrap();
                        }
                        black_box(m.finish_step())
                    })
                });
            }
        }
        g.finish();
    }
}

fn gather(c: &mut Criterion) {
    let mut g = c.benchmark_group("gather");
    for n in grid().1 {
        let batch = Batch::encode(&payload(&events(n, 0))).unwrap();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &batch, |b, batch| {
            b.iter(|| Batch::gather((0..batch.len()).step_by(2).map(|i| (black_box(batch), i))))
        });
    }
    g.finish();
}

criterion_group!(benches, encode, identity, receive, merge, gather);
criterion_main!(benches);
