//! The step without Python: every refusal kind from a crafted step, every
//! transition of a child's state, and properties over random steps.

use std::collections::HashMap;
use std::ops::Range;

use proptest::prelude::*;

use super::wire::{self, Written};
use super::*;
use crate::batch::Batch;
use crate::rule::Rule;
use crate::schema::BlockHash;
use crate::testing::{batch as encode, removed_blocks, stored};

const WORLD: i64 = 2;

/// A native container: its class, and the classes it is an instance of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Container {
    class: &'static str,
    bases: &'static [&'static str],
}

const LIST: Container = Container {
    class: "ListKVEvents",
    bases: &["KVConnectorKVEvents"],
};
const OTHER: Container = Container {
    class: "OtherKVEvents",
    bases: &["KVConnectorKVEvents"],
};
const NOT_EVENTS: Container = Container {
    class: "dict",
    bases: &[],
};

/// One output as a test sends it.
enum Sent {
    Buffer(Vec<u8>, Header, Vec<Option<Container>>),
    Damaged(Damage),
}

/// A step's outputs, as the binding would hold them.
struct Sending(Vec<Sent>);

impl Outputs for Sending {
    type Native = Container;

    fn len(&self) -> usize {
        self.0.len()
    }

    fn header(&self, i: usize) -> Result<&Header, Damage> {
        match &self.0[i] {
            Sent::Buffer(_, header, _) => Ok(header),
            Sent::Damaged(damage) => Err(damage.clone()),
        }
    }

    fn bytes(&self, i: usize, range: &Range<usize>) -> &[u8] {
        match &self.0[i] {
            Sent::Buffer(bytes, ..) => &bytes[range.clone()],
            Sent::Damaged(_) => unreachable!("the step reads no damaged output"),
        }
    }

    fn batch(&self, i: usize, range: &Range<usize>) -> Result<Batch, String> {
        Batch::from_vec(self.bytes(i, range).to_vec()).map_err(|e| e.to_string())
    }

    fn native(&self, i: usize, child: usize) -> Result<Container, String> {
        let Sent::Buffer(_, _, natives) = &self.0[i] else {
            unreachable!()
        };
        match natives.get(child).copied().flatten() {
            Some(c) if c.bases.contains(&"KVConnectorKVEvents") => Ok(c),
            Some(c) => Err(c.class.to_owned()),
            None => Err("NoneType".to_owned()),
        }
    }

    fn joins(&self, first: &Container, later: &Container) -> Result<(), String> {
        if first.class == later.class {
            Ok(())
        } else {
            Err(format!(
                "a {} container, where other ranks sent {} containers",
                later.class, first.class
            ))
        }
    }
}

/// What a test's worker sends for one child.
#[derive(Debug, Clone)]
enum Entry {
    Nothing,
    Batch {
        family: &'static str,
        factors: Option<Vec<i64>>,
        bytes: Vec<u8>,
    },
    Native(Container),
    Refused(&'static str),
}

fn batch_of(family: &'static str) -> Entry {
    Entry::Batch {
        family,
        factors: None,
        // Block hash 0, in "CPU": the block the healthy step removes.
        bytes: encode(&[stored(0, None)]).bytes().to_vec(),
    }
}

fn quorum_batch(factors: &[i64]) -> Entry {
    Entry::Batch {
        family: "mooncake",
        factors: Some(factors.to_vec()),
        bytes: encode(&[stored(1, Some(0))]).bytes().to_vec(),
    }
}

fn sent(rank: i64, seq: i64, settings: Option<&Settings>, entries: &[Entry]) -> Sent {
    let written: Vec<Written<'_>> = entries
        .iter()
        .map(|e| match e {
            Entry::Nothing => Written::Nothing,
            Entry::Batch {
                family,
                factors,
                bytes,
            } => Written::Batch {
                family,
                factors: factors.as_deref(),
                batch: bytes,
            },
            Entry::Native(_) => Written::Native,
            Entry::Refused(why) => Written::Refused(why),
        })
        .collect();
    let bytes = wire::write(rank, seq, settings, &written).expect("writes");
    let header = wire::parse(&bytes).expect("reads");
    let natives = entries
        .iter()
        .map(|e| match e {
            Entry::Native(c) => Some(*c),
            _ => None,
        })
        .collect();
    Sent::Buffer(bytes, header, natives)
}

/// A child's `(label, rule, factors)`, as its settings say them.
type ChildSpec = (&'static str, Option<&'static str>, Option<Vec<i64>>);

fn settings(rank: i64, children: &[ChildSpec]) -> Settings {
    Settings {
        version: "1".into(),
        world_size: WORLD,
        rank,
        kv_events: true,
        children: children
            .iter()
            .map(|(label, rule, factors)| ChildSettings {
                label: (*label).into(),
                rule: rule.map(str::to_owned),
                factors: factors.clone(),
            })
            .collect(),
    }
}

fn families() -> HashMap<String, ChildRule> {
    [
        ("lmcache", ChildRule::Merge(Rule::All)),
        ("umbp", ChildRule::Merge(Rule::Any)),
        ("mooncake", ChildRule::Merge(Rule::Quorum)),
        ("plain", ChildRule::Native),
    ]
    .into_iter()
    .map(|(f, r)| (f.to_owned(), r))
    .collect()
}

/// A step over `children`, past its first step when `started`.
struct Bench {
    merger: OutputMerger,
    children: Vec<ChildSpec>,
    seq: i64,
}

impl Bench {
    fn new(children: &[ChildSpec]) -> Bench {
        let merger = OutputMerger::new(StepConfig {
            settings: settings(-1, children),
            max_pending_steps: 4,
            families: families(),
            guard: true,
        })
        .expect("a valid configuration");
        Bench {
            merger,
            children: children.to_vec(),
            seq: 0,
        }
    }

    /// One step in which each rank in `ranks` sends `entries` (its
    /// settings with its first output).
    fn step(&mut self, ranks: &[i64], entries: &[Entry]) -> (Step, Vec<Vec<(i64, Container)>>) {
        let outputs = ranks
            .iter()
            .map(|&r| {
                let s = settings(r, &self.children);
                sent(r, self.seq, (self.seq == 0).then_some(&s), entries)
            })
            .collect();
        self.seq += 1;
        self.run(Sending(outputs))
    }

    fn run(&mut self, outputs: Sending) -> (Step, Vec<Vec<(i64, Container)>>) {
        let (took, natives) = self.merger.take(&outputs).expect("not misconfigured");
        (self.merger.merge(took), natives)
    }
}

fn kinds(step: &Step) -> Vec<(Kind, Option<i64>, Option<usize>)> {
    step.refusals
        .iter()
        .map(|r| (r.kind, r.rank, r.child))
        .collect()
}

fn merged_len(step: &Step, child: usize) -> Option<usize> {
    match &step.children[child].outcome {
        Outcome::Merged(p) => Some(p.len()),
        _ => None,
    }
}

const TWO: [ChildSpec; 2] = [("c0", None, None), ("c1", Some("any"), None)];

fn started() -> Bench {
    let mut bench = Bench::new(&TWO);
    let (step, _) = bench.step(&[0, 1], &[batch_of("lmcache"), batch_of("umbp")]);
    assert_eq!(kinds(&step), []);
    assert!(step.children[0].started && !step.children[1].started);
    bench
}

// -- every refusal kind ------------------------------------------------------

#[test]
fn each_refusal_kind_comes_from_its_input() {
    let good = || vec![batch_of("lmcache"), batch_of("umbp")];
    type Run = Box<dyn Fn(&mut Bench) -> Step>;
    let cases: Vec<(Kind, Run, Vec<_>)> = vec![
        (
            Kind::Output,
            Box::new(move |b: &mut Bench| {
                b.run(Sending(vec![Sent::Damaged(Damage {
                    rank: Some(1),
                    why: "cut".into(),
                })]))
                .0
            }),
            vec![(Kind::Output, Some(1), None)],
        ),
        (
            Kind::Rank,
            Box::new(move |b: &mut Bench| b.step(&[2], &good()).0),
            vec![(Kind::Rank, Some(2), None)],
        ),
        (
            Kind::Duplicate,
            Box::new(move |b: &mut Bench| b.step(&[1, 1], &good()).0),
            vec![(Kind::Duplicate, Some(1), None)],
        ),
        (
            Kind::Settings,
            Box::new(move |b: &mut Bench| {
                let mut s = settings(1, &TWO);
                s.version = "0".into();
                b.run(Sending(vec![sent(1, 1, Some(&s), &good())])).0
            }),
            vec![(Kind::Settings, Some(1), None)],
        ),
        (
            Kind::Misconfigured,
            Box::new(move |b: &mut Bench| {
                let mut s = settings(1, &TWO);
                s.kv_events = false;
                b.run(Sending(vec![sent(1, 1, Some(&s), &good())]));
                b.run(Sending(vec![sent(1, 2, None, &good())])).0
            }),
            vec![(Kind::Misconfigured, Some(1), None)],
        ),
        (
            Kind::Children,
            Box::new(move |b: &mut Bench| b.step(&[0], &[Entry::Nothing]).0),
            vec![(Kind::Children, Some(0), None)],
        ),
        (
            Kind::Encode,
            Box::new(move |b: &mut Bench| {
                b.step(&[0], &[Entry::Refused("no room"), batch_of("umbp")])
                    .0
            }),
            vec![(Kind::Encode, Some(0), Some(0))],
        ),
        (
            Kind::Native,
            Box::new(move |b: &mut Bench| {
                b.step(&[0], &[Entry::Native(NOT_EVENTS), batch_of("umbp")])
                    .0
            }),
            vec![(Kind::Native, Some(0), Some(0))],
        ),
        (
            Kind::Family,
            Box::new(move |b: &mut Bench| b.step(&[0], &[batch_of("umbp"), batch_of("umbp")]).0),
            vec![(Kind::Family, Some(0), Some(0))],
        ),
        (
            Kind::Factors,
            // Its own bench: a child of rule "quorum" without factors.
            Box::new(move |_: &mut Bench| {
                Bench::new(&[("q", Some("quorum"), None)])
                    .step(&[0], &[batch_of("mooncake")])
                    .0
            }),
            vec![(Kind::Factors, Some(0), Some(0))],
        ),
        (
            Kind::Batch,
            Box::new(move |b: &mut Bench| {
                let mut entries = good();
                entries[1] = Entry::Batch {
                    family: "umbp",
                    factors: None,
                    bytes: vec![1, 2, 3],
                };
                b.step(&[0], &entries).0
            }),
            vec![(Kind::Batch, Some(0), Some(1))],
        ),
    ];
    let mut seen = vec![Kind::Merge];
    for (kind, run, expected) in cases {
        let mut bench = started();
        let step = run(&mut bench);
        assert_eq!(kinds(&step), expected, "{kind}");
        assert!(step.refusals.iter().all(|r| !r.detail.is_empty()));
        seen.push(kind);
    }
    assert!(Kind::ALL.iter().all(|k| seen.contains(k)), "{seen:?}");
}

#[test]
fn a_merge_refusal_names_the_group_its_factors_miss() {
    // Factors for one group, a store in group 1: the merger refuses it.
    let mut bench = Bench::new(&[("q", Some("quorum"), Some(vec![1]))]);
    let entry = Entry::Batch {
        family: "mooncake",
        factors: None,
        bytes: encode(&[stored(1, Some(1))]).bytes().to_vec(),
    };
    let (step, _) = bench.step(&[0, 1], &[entry]);
    assert_eq!(
        kinds(&step),
        [
            (Kind::Merge, Some(0), Some(0)),
            (Kind::Merge, Some(1), Some(0))
        ]
    );
    let detail = &step.refusals[0].detail;
    assert!(
        detail.starts_with(
            "kv_events_merge='quorum' with replication factors (1,) (from \
             kv_events_replication_factors) does not cover its KV cache group"
        ),
        "{detail}"
    );
}

#[test]
fn settings_that_differ_in_the_first_step_are_a_misconfiguration() {
    let mut bench = Bench::new(&TWO);
    let mut s = settings(0, &TWO);
    s.world_size = 4;
    let outputs = Sending(vec![sent(
        0,
        0,
        Some(&s),
        &[Entry::Nothing, Entry::Nothing],
    )]);
    let Err(Misconfigured(why)) = bench.merger.take(&outputs) else {
        panic!("a start-up misconfiguration")
    };
    assert!(
        why.contains("rank 0's settings differ")
            && why.contains("world_size: worker 4, scheduler 2")
    );
    // Nothing changed: the same step with agreeing settings is the first.
    let (step, _) = bench.step(&[0, 1], &[batch_of("lmcache"), batch_of("umbp")]);
    assert_eq!((step.step, kinds(&step)), (0, vec![]));
}

#[test]
fn a_gap_in_a_ranks_seq_is_reported() {
    let mut bench = started();
    let good = [batch_of("lmcache"), batch_of("umbp")];
    let (step, _) = bench.run(Sending(vec![
        sent(0, 4, None, &good),
        sent(1, 1, None, &good),
    ]));
    assert_eq!(step.gaps, [(0, 1, 3)]);
    assert_eq!(step.ranks, [0, 1]);
}

// -- configuration -------------------------------------------------------------

#[test]
fn a_configuration_is_checked_once_with_the_setting_named() {
    let fault = |rule: Option<&str>, factors: Option<&[i64]>| {
        ChildConfig::new(rule, factors).unwrap_err().to_string()
    };
    assert_eq!(
        fault(Some("most"), None),
        "kv_events_merge='most' is not a merge rule; use one of 'all', 'quorum', 'any', 'native'"
    );
    assert_eq!(
        fault(None, Some(&[1, 0])),
        "kv_events_replication_factors=[1, 0] must be a non-empty list of integers >= 1, one \
         per KV cache group"
    );
    assert!(fault(None, Some(&[])).contains("non-empty"));
    assert!(fault(None, Some(&[1 << 40])).contains("integers >= 1"));
    assert_eq!(
        fault(Some("all"), Some(&[2])),
        "kv_events_replication_factors is only used by kv_events_merge='quorum', not \
         kv_events_merge='all'"
    );
    for rule in [None, Some("quorum")] {
        assert!(ChildConfig::new(rule, Some(&[2, 1])).is_ok());
    }
    let mut too_large = settings(-1, &[("c0 (X)", Some("quorum"), Some(vec![3]))]);
    too_large.world_size = crate::MAX_WORLD_SIZE as i64 + 1;
    let Err(Misconfigured(why)) = OutputMerger::new(StepConfig {
        settings: too_large,
        max_pending_steps: 4,
        families: families(),
        guard: true,
    }) else {
        panic!("no merger takes a world that large")
    };
    assert!(
        why.starts_with(
            "c0 (X): rule 'quorum' with replication factors (3,) (from \
             kv_events_replication_factors): world_size must be"
        ),
        "{why}"
    );
}

#[test]
fn the_configured_rule_and_factors_win() {
    let all = ChildRule::Merge(Rule::All);
    let quorum = ChildRule::Merge(Rule::Quorum);
    let inferred = ChildConfig::new(None, None).unwrap();
    assert_eq!(inferred.rule_for(all), all);
    assert_eq!(
        inferred.plan(ChildRule::Native, None),
        Err(PlanFault::Native)
    );
    assert_eq!(inferred.plan(quorum, None), Err(PlanFault::NoFactors));
    assert_eq!(
        inferred.plan(quorum, Some(&[0])),
        Err(PlanFault::Factors(vec![0]))
    );
    let plan = inferred.plan(quorum, Some(&[2])).unwrap();
    assert_eq!(
        (plan.factors, plan.source),
        (Some(vec![2]), Source::Container)
    );
    let configured = ChildConfig::new(Some("quorum"), Some(&[1])).unwrap();
    assert_eq!(configured.rule_for(ChildRule::Native), quorum);
    // Configured factors win, and the reported ones are not even checked.
    let plan = configured.plan(all, Some(&[0])).unwrap();
    assert_eq!((plan.factors, plan.source), (Some(vec![1]), Source::Config));
    // Only "quorum" uses factors.
    let plan = inferred.plan(all, Some(&[2])).unwrap();
    assert_eq!((plan.factors, plan.source), (None, Source::Nowhere));
}

// -- a child's state --------------------------------------------------------------

fn state(bench: &Bench, child: usize) -> &'static str {
    match &bench.merger.children()[child].state {
        State::Unresolved => "unresolved",
        State::Native { seen: false } => "native",
        State::Native { seen: true } => "native, seen",
        State::Merge {
            family: None,
            merging: None,
        } => "merge, waiting",
        State::Merge {
            family: None,
            merging: Some(_),
        } => "merge",
        State::Merge {
            family: Some(_),
            merging: Some(_),
        } => "merge, family",
        State::Merge {
            family: Some(_),
            merging: None,
        } => "merge, family, waiting",
    }
}

#[test]
fn each_configuration_starts_in_its_state() {
    let bench = Bench::new(&[
        ("a", None, None),
        ("b", Some("native"), None),
        ("c", Some("quorum"), None),
        ("d", Some("all"), None),
        ("e", Some("quorum"), Some(vec![1])),
    ]);
    let states: Vec<_> = (0..5).map(|i| state(&bench, i)).collect();
    assert_eq!(
        states,
        ["unresolved", "native", "merge, waiting", "merge", "merge"]
    );
}

#[test]
fn every_transition_of_a_childs_state() {
    struct Case {
        child: ChildSpec,
        first: Entry,
        then: Entry,
        after_first: &'static str,
        refused_first: Option<Kind>,
        refused_then: Option<Kind>,
    }
    let case = |child, first, after_first, refused_first, then, refused_then| Case {
        child,
        first,
        then,
        after_first,
        refused_first,
        refused_then,
    };
    let native = || Entry::Native(LIST);
    let cases = [
        // Unresolved: the first part decides.
        case(
            ("a", None, None),
            native(),
            "native, seen",
            None,
            batch_of("lmcache"),
            Some(Kind::Family),
        ),
        case(
            ("a", None, None),
            batch_of("lmcache"),
            "merge, family",
            None,
            native(),
            Some(Kind::Family),
        ),
        case(
            ("a", None, None),
            batch_of("lmcache"),
            "merge, family",
            None,
            batch_of("umbp"),
            Some(Kind::Family),
        ),
        case(
            ("a", None, None),
            batch_of("plain"),
            "unresolved",
            Some(Kind::Family),
            native(),
            None,
        ),
        case(
            ("a", None, None),
            batch_of("mooncake"),
            "unresolved",
            Some(Kind::Factors),
            quorum_batch(&[1]),
            None,
        ),
        case(
            ("a", None, None),
            batch_of("nobody"),
            "unresolved",
            Some(Kind::Family),
            batch_of("umbp"),
            None,
        ),
        case(
            ("a", None, None),
            Entry::Nothing,
            "unresolved",
            None,
            native(),
            None,
        ),
        // Native, configured.
        case(
            ("b", Some("native"), None),
            batch_of("lmcache"),
            "native",
            Some(Kind::Family),
            native(),
            None,
        ),
        case(
            ("b", Some("native"), None),
            native(),
            "native, seen",
            None,
            Entry::Native(OTHER),
            None,
        ),
        // A configured merge rule: the first batch fixes the family.
        case(
            ("d", Some("all"), None),
            native(),
            "merge",
            Some(Kind::Family),
            batch_of("umbp"),
            None,
        ),
        case(
            ("d", Some("all"), None),
            batch_of("plain"),
            "merge, family",
            None,
            batch_of("lmcache"),
            Some(Kind::Family),
        ),
        // "quorum" without factors waits for a container's.
        case(
            ("c", Some("quorum"), None),
            batch_of("mooncake"),
            "merge, waiting",
            Some(Kind::Factors),
            quorum_batch(&[2]),
            None,
        ),
        case(
            ("c", Some("quorum"), None),
            quorum_batch(&[0]),
            "merge, waiting",
            Some(Kind::Factors),
            quorum_batch(&[1]),
            None,
        ),
        case(
            ("c", Some("quorum"), None),
            quorum_batch(&[1]),
            "merge, family",
            None,
            quorum_batch(&[2]),
            Some(Kind::Factors),
        ),
        case(
            ("c", Some("quorum"), None),
            quorum_batch(&[1]),
            "merge, family",
            None,
            quorum_batch(&[1]),
            None,
        ),
        // Configured factors: whatever a container reports is not used.
        case(
            ("e", Some("quorum"), Some(vec![1])),
            quorum_batch(&[0]),
            "merge, family",
            None,
            quorum_batch(&[2]),
            None,
        ),
    ];
    for (n, c) in cases.into_iter().enumerate() {
        let mut bench = Bench::new(std::slice::from_ref(&c.child));
        let (step, _) = bench.step(&[0], std::slice::from_ref(&c.first));
        let got: Vec<_> = step.refusals.iter().map(|r| r.kind).collect();
        assert_eq!(
            got,
            c.refused_first.into_iter().collect::<Vec<_>>(),
            "case {n}: first"
        );
        assert_eq!(state(&bench, 0), c.after_first, "case {n}");
        // The next part, from the other rank in the next step.
        let (step, _) = bench.step(&[1], std::slice::from_ref(&c.then));
        let got: Vec<_> = step.refusals.iter().map(|r| r.kind).collect();
        assert_eq!(
            got,
            c.refused_then.into_iter().collect::<Vec<_>>(),
            "case {n}: then"
        );
    }
}

#[test]
fn natives_of_another_class_than_the_first_are_refused() {
    let mut bench = Bench::new(&[("a", None, None)]);
    let (step, natives) = bench.step(&[0, 1], &[Entry::Native(LIST)]);
    assert!(matches!(step.children[0].outcome, Outcome::Native));
    assert_eq!(natives[0], [(0, LIST), (1, LIST)]);
    let outputs = Sending(vec![
        sent(1, 1, None, &[Entry::Native(OTHER)]),
        sent(0, 1, None, &[Entry::Native(LIST)]),
    ]);
    let (step, natives) = bench.run(outputs);
    // Rank order: rank 0's LIST comes first, rank 1's OTHER is refused.
    assert_eq!(kinds(&step), [(Kind::Native, Some(1), Some(0))]);
    assert_eq!(natives[0], [(0, LIST)]);
}

#[test]
fn the_step_number_is_the_one_in_every_result() {
    let mut bench = started();
    assert_eq!(bench.merger.steps(), 1);
    let (step, _) = bench.step(&[0, 1], &[batch_of("lmcache"), batch_of("umbp")]);
    assert_eq!(step.step, 1);
    assert_eq!(bench.merger.steps(), 2);
}

#[test]
fn a_healthy_step_publishes_each_event_once() {
    let mut bench = Bench::new(&TWO);
    let (step, _) = bench.step(&[0, 1], &[batch_of("lmcache"), batch_of("umbp")]);
    assert_eq!(
        (merged_len(&step, 0), merged_len(&step, 1)),
        (Some(1), Some(1))
    );
    let entries = [
        Entry::Batch {
            family: "lmcache",
            factors: None,
            bytes: encode(&[removed_blocks(&[BlockHash::Int(0)], Some("CPU"))])
                .bytes()
                .to_vec(),
        },
        Entry::Nothing,
    ];
    let (step, _) = bench.step(&[0], &entries);
    assert_eq!(merged_len(&step, 0), Some(0), "rank 1 has not reported it");
    let (step, _) = bench.step(&[1], &entries);
    assert_eq!(merged_len(&step, 0), Some(1));
    assert!(bench.merger.children()[0]
        .describe()
        .unwrap()
        .starts_with("rule 'all'"));
}

// -- properties ---------------------------------------------------------------------

fn entry() -> impl Strategy<Value = Entry> {
    prop_oneof![
        Just(Entry::Nothing),
        prop::sample::select(vec!["lmcache", "umbp", "mooncake", "plain", "nobody"])
            .prop_map(batch_of),
        prop::collection::vec(-1i64..4, 0..3).prop_map(|f| quorum_batch(&f)),
        Just(Entry::Native(LIST)),
        Just(Entry::Native(OTHER)),
        Just(Entry::Native(NOT_EVENTS)),
        Just(Entry::Refused("why")),
        Just(Entry::Batch {
            family: "umbp",
            factors: None,
            bytes: vec![0; 7]
        }),
    ]
}

/// A child's rule setting, as any configuration may give it.
fn child() -> impl Strategy<Value = ChildSpec> {
    prop_oneof![
        Just(("a", None, None)),
        Just(("b", Some("native"), None)),
        Just(("c", Some("quorum"), None)),
        Just(("d", Some("any"), None)),
        Just(("e", Some("quorum"), Some(vec![1]))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Whatever the workers send, the step never panics, each refusal names
    /// a rank and child it may, and a child whose parts are refused keeps
    /// the state it had: the reference is a second bench that never got the
    /// refused parts.
    #[test]
    fn a_refused_part_changes_nothing(
        spec in child(),
        steps in prop::collection::vec(entry(), 1..12),
    ) {
        let mut bench = Bench::new(std::slice::from_ref(&spec));
        let mut clean = Bench::new(&[spec]);
        for e in steps {
            let (step, _) = bench.step(&[0, 1], std::slice::from_ref(&e));
            for r in &step.refusals {
                prop_assert!(r.rank.is_some() && r.child == Some(0));
            }
            // Both ranks sent the same part: both taken, or both refused.
            let kept = if step.refusals.is_empty() { e } else { Entry::Nothing };
            let (again, _) = clean.step(&[0, 1], &[kept]);
            prop_assert_eq!(again.refusals.len(), 0);
            prop_assert_eq!(state(&clean, 0), state(&bench, 0));
            prop_assert_eq!(merged_len(&again, 0), merged_len(&step, 0));
        }
    }

    /// A child's family, once fixed by a part the step took, takes no part
    /// of another family: a model of the rule "one family per child".
    #[test]
    fn a_child_keeps_its_first_family(
        steps in prop::collection::vec(entry(), 1..12),
    ) {
        let mut bench = Bench::new(&[("a", None, None)]);
        let mut fixed: Option<&str> = None;
        for e in steps {
            let (step, _) = bench.step(&[0], std::slice::from_ref(&e));
            let family = match &e {
                Entry::Batch { family, .. } => Some(*family),
                Entry::Native(_) => Some("native"),
                _ => None,
            };
            let took = step.refusals.is_empty();
            if let (Some(f), Some(family)) = (fixed, family) {
                if f != family {
                    prop_assert!(!took, "{family} after {f}");
                    // A damaged batch, or no container, is refused for that first.
                    let kind = step.refusals[0].kind;
                    prop_assert!(matches!(kind, Kind::Family | Kind::Batch | Kind::Native));
                }
            }
            if took && fixed.is_none() {
                fixed = family;
            }
        }
    }
}
