//! Soak run: a long, seeded, skewed workload through one merger per rule,
//! each checked step by step against the naive model of docs/merge-rules.md
//! in `reference.rs`, with the process's resident memory sampled as it goes.
//!
//! ```text
//! cargo run --release -p kvmerge-core --example soak -- --steps 1000000
//!     [--seed N] [--world W] [--window STEPS] [--rss-slack-mib MIB]
//! ```
//!
//! The workload, per step: a few events (stores in two KV cache groups,
//! removals; keys skewed so the same event recurs across steps; sometimes a
//! burst, sometimes a clear) that every rank should report. Each rank then
//! deviates: it runs late for a while (now and then beyond the pending
//! window), drops or repeats an event now and then, sometimes adds nothing
//! in a step. The last rank disappears for a while at regular intervals and
//! comes back, alternately having lost what it missed (a crashed worker) and
//! delivering it all at once (outputs salvaged into a later step). Every
//! 200,000 steps, from step 100,000 on, everything is `reset()` (the
//! connector's `reset_cache`).
//!
//! Exits non-zero if any merger publishes anything other than its model, if
//! a counter differs from the model's, if the counter identity breaks, or if
//! resident memory grows by more than `--rss-slack-mib` (default 4) between
//! the warm-up sample and the end.

mod reference;

use std::collections::VecDeque;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use kvmerge_core::msgpack::write_array_header;
use kvmerge_core::testing::{clear, stored_with};
use kvmerge_core::{Batch, Carriers, Identity, Merger, MergerConfig, Rule, Stats};
use reference::{Counters, Event, Kind, Reference};

struct Args {
    steps: u64,
    seed: u64,
    world: usize,
    window: u64,
    rss_slack_mib: f64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        steps: 1_000_000,
        seed: 0x006b_766d_6572_6765, // "kvmerge"
        world: 4,
        window: 8,
        rss_slack_mib: 4.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--steps" => a.steps = value.parse().map_err(|e| bad(&e))?,
            "--seed" => a.seed = value.parse().map_err(|e| bad(&e))?,
            "--world" => a.world = value.parse().map_err(|e| bad(&e))?,
            "--window" => a.window = value.parse().map_err(|e| bad(&e))?,
            "--rss-slack-mib" => a.rss_slack_mib = value.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.world < 2 {
        return Err("--world must be at least 2 (one rank disappears)".into());
    }
    Ok(a)
}

/// splitmix64: small, seeded, good enough for a workload.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True with probability 1 / n.
    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
}

/// `BlockRemoved(block_hashes=[h], medium=None)` as msgspec encodes it.
fn removed(h: u64) -> Vec<u8> {
    let mut e = vec![0x83, 0xa4];
    e.extend_from_slice(b"type");
    e.push(0xa0 | 12);
    e.extend_from_slice(b"BlockRemoved");
    e.push(0xa0 | 12);
    e.extend_from_slice(b"block_hashes");
    e.extend_from_slice(&[0x91, 0xcf]);
    e.extend_from_slice(&h.to_be_bytes());
    e.push(0xa6);
    e.extend_from_slice(b"medium");
    e.push(0xc0);
    e
}

/// One event as the workload knows it: its bytes, and what the model needs.
#[derive(Clone)]
struct Ev {
    bytes: Arc<Vec<u8>>,
    event: Event,
}

fn make_event(rng: &mut Rng) -> Ev {
    // Skewed keys: most events come from a small hot set, so the same event
    // is reported again and again across steps.
    let key = if rng.below(100) < 85 {
        rng.below(48)
    } else {
        1000 + rng.below(1_000_000)
    };
    let (bytes, kind) = if rng.below(4) < 3 {
        let group = (key % 2) as u8;
        let bytes = stored_with(key, Some(group), 1 + (key % 3) as usize, 8);
        (
            bytes,
            Kind::Stored {
                group: Some(group as i64),
            },
        )
    } else {
        (removed(key), Kind::Removed)
    };
    ev(bytes, kind)
}

fn ev(bytes: Vec<u8>, kind: Kind) -> Ev {
    // The model's identity comes from the bytes, not from the engine.
    let event = Event {
        id: Identity::of(&bytes),
        kind,
    };
    Ev {
        bytes: Arc::new(bytes),
        event,
    }
}

/// What one rank will deliver, and when.
#[derive(Default)]
struct Rank {
    outbox: VecDeque<(u64, Ev)>,
    lag: u64,
    last_release: u64,
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
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

/// One rule's merger, its reference model, and the most reports it held
/// pending.
struct RuleCheck {
    rule: Rule,
    merger: Merger,
    model: Reference,
    max_pending: u64,
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("soak: {e}");
            return ExitCode::from(2);
        }
    };
    let (w, window) = (args.world, args.window);
    // Group 1 is replicated on half the ranks under "quorum".
    let factors = vec![1, (w as u32 / 2).max(1)];
    let mut checks: Vec<RuleCheck> = [Rule::All, Rule::Quorum, Rule::Any]
        .into_iter()
        .map(|rule| {
            let f = (rule == Rule::Quorum).then(|| factors.clone());
            let cfg = MergerConfig {
                carriers: Carriers {
                    world_size: w,
                    rule,
                    replication_factors: f.clone(),
                },
                max_pending_steps: window,
            };
            RuleCheck {
                rule,
                merger: Merger::new(cfg).expect("valid config"),
                model: Reference::new(w, rule, f, window),
                max_pending: 0,
            }
        })
        .collect();

    let mut rng = Rng(args.seed);
    let mut ranks: Vec<Rank> = (0..w).map(|_| Rank::default()).collect();
    let gone = w - 1;
    // The last rank disappears for `absence` steps every `period` steps.
    let (period, absence) = (50_000u64, 5 * window.max(1) + 1);
    let mut incidents = (0u64, 0u64); // (crashes, salvages)
    let mut resets = 0u64;
    let mut truth_events = 0u64;
    let mut truth_clears = 0u64;
    let mut samples: Vec<(u64, u64)> = vec![(0, rss_kib())];
    let warm_at = (args.steps / 100).clamp(1, 10_000);
    let started = Instant::now();

    println!(
        "soak: {} steps, world {w}, max_pending_steps {window}, seed {}, rules all/quorum/any",
        args.steps, args.seed
    );
    for step in 0..args.steps {
        // 1. This step's events, as every rank should report them.
        let n = if rng.one_in(1000) {
            24
        } else {
            [0, 1, 1, 2, 2, 3, 4, 6][rng.below(8) as usize]
        };
        let mut truth: Vec<Ev> = (0..n).map(|_| make_event(&mut rng)).collect();
        if rng.one_in(800) {
            truth.push(ev(clear(), Kind::Cleared));
            truth_clears += 1;
        }
        truth_events += truth.len() as u64;

        // 2. The disappearing rank: odd incidents crash, even ones salvage.
        let phase = (step + period / 2) % period;
        let absent = step >= period / 2 && phase < absence;
        let crash = (step + period / 2) / period % 2 == 1;
        if absent && phase == 0 {
            if crash {
                incidents.0 += 1;
            } else {
                incidents.1 += 1;
            }
        }

        // 3. Each rank's deviations, then its delivery.
        for (r, rank) in ranks.iter_mut().enumerate() {
            if rng.one_in(300) {
                rank.lag = match rng.below(100) {
                    0..=79 => 0,
                    80..=94 => 1 + rng.below(3),
                    _ => window + 1 + rng.below(4),
                };
            }
            if r == gone && absent && crash {
                // A crashed worker: what it had not delivered is lost.
                rank.outbox.clear();
                continue;
            }
            let release = rank.last_release.max(step + rank.lag);
            rank.last_release = release;
            for e in &truth {
                if rng.one_in(2000) {
                    continue; // never reported by this rank
                }
                rank.outbox.push_back((release, e.clone()));
                if rng.one_in(2000) {
                    rank.outbox.push_back((release, e.clone())); // own duplicate
                }
            }
        }
        let mut adds: Vec<(usize, Arc<Batch>, Vec<Event>)> = Vec::new();
        for (r, rank) in ranks.iter_mut().enumerate() {
            if r == gone && absent {
                continue; // silent: no batch at all
            }
            let mut payload = Vec::new();
            let mut events = Vec::new();
            let mut due = Vec::new();
            while rank.outbox.front().is_some_and(|(t, _)| *t <= step) {
                due.push(rank.outbox.pop_front().expect("front").1);
            }
            if due.is_empty() && rng.one_in(10) {
                continue; // nothing to say, and said nothing
            }
            write_array_header(&mut payload, due.len());
            for e in &due {
                payload.extend_from_slice(&e.bytes);
                events.push(e.event);
            }
            let batch = Batch::encode(&payload).expect("workload events are valid");
            adds.push((r, Arc::new(batch), events));
        }

        // 4. Every rule's merger merges the same batches; its model must agree.
        for check in &mut checks {
            for (r, batch, events) in &adds {
                check
                    .merger
                    .add(*r as i64, batch.clone())
                    .expect("valid add");
                check
                    .model
                    .add(*r as i64, events.clone())
                    .expect("valid add");
            }
            let out = check.merger.finish_step();
            let want = check.model.finish_step();
            if !out.identities().eq(want.iter().copied()) {
                eprintln!(
                    "soak: step {step}, rule {:?}: published {} events, the model {}",
                    check.rule.name(),
                    out.len(),
                    want.len()
                );
                return ExitCode::FAILURE;
            }
            let s = check.merger.stats();
            if s.reports != s.consumed + s.cleared + s.expired + s.pending {
                eprintln!("soak: step {step}: counter identity broken: {s:?}");
                return ExitCode::FAILURE;
            }
            if counters(s) != check.model.counters() {
                eprintln!(
                    "soak: step {step}, rule {:?}: counters {s:?}, model {:?}",
                    check.rule.name(),
                    check.model.counters()
                );
                return ExitCode::FAILURE;
            }
            check.max_pending = check.max_pending.max(s.pending);
        }

        // 5. Now and then, the connector's reset_cache.
        if step % 200_000 == 100_000 {
            resets += 1;
            for check in &mut checks {
                check.merger.reset();
                check.model.reset();
            }
        }

        let done = step + 1;
        if done == warm_at || done % (args.steps / 20).max(1) == 0 || done == args.steps / 2 {
            samples.push((done, rss_kib()));
        }
        if done % (args.steps / 10).max(1) == 0 {
            println!(
                "  step {done:>9}: rss {:7.2} MiB, {:6.1} s",
                mib(rss_kib()),
                started.elapsed().as_secs_f64()
            );
        }
    }
    samples.push((args.steps, rss_kib()));
    let elapsed = started.elapsed().as_secs_f64();

    let at = |step: u64| {
        samples
            .iter()
            .find(|(s, _)| *s >= step)
            .copied()
            .unwrap_or(*samples.last().expect("samples"))
    };
    let (start, warm, middle, end) = (
        samples[0],
        at(warm_at),
        at(args.steps / 2),
        *samples.last().expect("samples"),
    );
    let max_after_warm = samples
        .iter()
        .filter(|(s, _)| *s >= warm.0)
        .map(|(_, k)| *k)
        .max()
        .unwrap_or(0);
    println!(
        "done in {elapsed:.1} s ({:.2} us/step)",
        elapsed * 1e6 / args.steps as f64
    );
    println!(
        "workload: {truth_events} events ({truth_clears} clears) in {} steps; \
         rank {gone} absent {} times for {absence} steps ({} crashed, {} salvaged); {resets} resets",
        args.steps,
        incidents.0 + incidents.1,
        incidents.0,
        incidents.1
    );
    println!(
        "rss: start (step {}) {:.2} MiB, warm (step {}) {:.2} MiB, middle (step {}) {:.2} MiB, \
         end (step {}) {:.2} MiB, max after warm-up {:.2} MiB",
        start.0,
        mib(start.1),
        warm.0,
        mib(warm.1),
        middle.0,
        mib(middle.1),
        end.0,
        mib(end.1),
        mib(max_after_warm)
    );
    println!("rule    | published (model)   | reports   | consumed  | cleared | expired | pending | max pending");
    for check in &checks {
        let s = check.merger.stats();
        let m = check.model.counters();
        println!(
            "{:<7} | {:>9} ({:>9}) | {:>9} | {:>9} | {:>7} | {:>7} | {:>7} | {:>11}",
            check.rule.name(),
            s.published,
            m.published,
            s.reports,
            s.consumed,
            s.cleared,
            s.expired,
            s.pending,
            check.max_pending
        );
    }
    let growth = mib(max_after_warm) - mib(warm.1);
    if growth > args.rss_slack_mib {
        eprintln!(
            "soak: resident memory grew by {growth:.2} MiB after warm-up (allowed {} MiB)",
            args.rss_slack_mib
        );
        return ExitCode::FAILURE;
    }
    println!(
        "ok: every step equal to the model; rss growth after warm-up {growth:.2} MiB (allowed {} MiB)",
        args.rss_slack_mib
    );
    ExitCode::SUCCESS
}
