//! What a merger holds for its pending reports, measured with a counting
//! global allocator (a test binary of its own, with a single test: no other
//! thread allocates while it measures). docs/benchmarks.md, "Memory", shows
//! the figures this prints (`cargo test -p kvmerge-core --test
//! pending_memory -- --nocapture`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use kvmerge_core::testing::{payload, stored_with};
use kvmerge_core::{Batch, Carriers, Merger, MergerConfig, Rule, DEFAULT_MAX_PENDING_STEPS};

struct Counting;

/// Bytes allocated and not yet freed.
static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The bound: what a pending report may cost the merger beyond its batch's
/// bytes (its queue node, its share of the identity index, their spare
/// capacity). Measured at 306 bytes where every report is queued and
/// indexed, none where batches are held whole (docs/benchmarks.md,
/// "Memory"); a quarter more is allowed.
const MAX_BYTES_PER_PENDING_REPORT: usize = 384;

const WORLD: usize = 8;
const EVENTS: usize = 512;

/// One-block `BlockStored`s (the Mooncake store's shape): rank `r`'s batch
/// of step `s`, as its worker sends it. `distinct`: no two ranks report the
/// same event, so nothing ever completes and every report waits until it
/// expires (the most a merger holds); else every rank reports the same.
fn step_batch(carriers: &Carriers, s: u64, r: usize, distinct: bool) -> Arc<Batch> {
    let owner = if distinct { r as u64 } else { 0 };
    let evs: Vec<Vec<u8>> = (0..EVENTS as u64)
        .map(|i| stored_with(((s * 64 + owner) << 20) + i, None, 1, 16))
        .collect();
    let b = Batch::encode_for(&payload(&evs), Some((carriers, r))).expect("valid events");
    Arc::new(b)
}

struct Held {
    /// Bytes the merger holds beyond what it held empty.
    bytes: usize,
    /// Of those, its batches' own bytes.
    batch_bytes: usize,
    pending: u64,
}

/// Runs `steps` steps in which `present` ranks report (each a batch of
/// `EVENTS` events), then measures what the merger holds.
fn hold(rule: Rule, distinct: bool, present: usize, steps: u64) -> Held {
    let mut cfg = MergerConfig::new(WORLD, rule);
    cfg.carriers.replication_factors = (rule == Rule::Quorum).then(|| vec![1]);
    let carriers = cfg.carriers.clone();
    let mut m = Merger::new(cfg).unwrap();
    let empty = LIVE.load(Ordering::Relaxed);
    // The batches the merger still holds: those of the last
    // `max_pending_steps` steps.
    let mut sizes = std::collections::VecDeque::new();
    for s in 0..steps {
        let batches: Vec<(i64, Arc<Batch>)> = (0..present)
            .map(|r| (r as i64, step_batch(&carriers, s, r, distinct)))
            .collect();
        sizes.push_back(batches.iter().map(|(_, b)| b.bytes().len()).sum::<usize>());
        if sizes.len() as u64 > DEFAULT_MAX_PENDING_STEPS {
            sizes.pop_front();
        }
        m.add_all(batches).unwrap();
        drop(m.finish_step_published());
    }
    let bytes = (LIVE.load(Ordering::Relaxed) - empty) as usize;
    Held {
        bytes,
        batch_bytes: sizes.iter().sum(),
        pending: m.stats().pending,
    }
}

#[test]
fn a_pending_report_costs_a_bounded_number_of_bytes() {
    let steps = 3 * DEFAULT_MAX_PENDING_STEPS;
    let window = DEFAULT_MAX_PENDING_STEPS * (WORLD * EVENTS) as u64;
    for (what, rule, distinct, present, pending) in [
        // Every rank disagrees: every report queued and indexed until it
        // expires, the full window of every rank.
        ("all, ranks disagree", Rule::All, true, WORLD, window),
        ("quorum, ranks disagree", Rule::Quorum, true, WORLD, window),
        // One rank silent: the others' batches held whole.
        (
            "all, one rank silent",
            Rule::All,
            false,
            WORLD - 1,
            window / WORLD as u64 * (WORLD - 1) as u64,
        ),
    ] {
        let held = hold(rule, distinct, present, steps);
        assert_eq!(held.pending, pending, "{what}: the window is full");
        let overhead = held.bytes.saturating_sub(held.batch_bytes);
        let per_report = overhead as f64 / held.pending as f64;
        println!(
            "{what}: {} pending reports hold {:.1} MiB: {:.1} MiB of batches \
             ({:.0} bytes a report), {:.1} MiB besides ({per_report:.0} bytes a report)",
            held.pending,
            held.bytes as f64 / (1 << 20) as f64,
            held.batch_bytes as f64 / (1 << 20) as f64,
            held.batch_bytes as f64 / held.pending as f64,
            overhead as f64 / (1 << 20) as f64,
        );
        assert!(
            held.bytes >= held.batch_bytes,
            "{what}: the merger holds its batches"
        );
        assert!(
            overhead <= MAX_BYTES_PER_PENDING_REPORT * held.pending as usize,
            "{what}: {per_report:.0} bytes a pending report, more than \
             {MAX_BYTES_PER_PENDING_REPORT}"
        );
    }
}
