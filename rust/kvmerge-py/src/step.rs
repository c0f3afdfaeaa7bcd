//! `OutputMerger`: the scheduler's step of `KVMergeMultiConnector`, every
//! check and every merge of it in one call.
//!
//! It holds what the step needs across steps: each rank's last `seq` and
//! whether its settings differed, and each child's mode, family, rule and
//! merger. Given one step's worker outputs it checks each output and each
//! child's part of it once, here and nowhere else, merges what passes, and
//! returns per child the merged events (or the native containers), and
//! every refusal as a `Refusal`: kind, rank, child, detail. Python logs,
//! counts and hands the events on. A refused batch costs only itself: that
//! rank's batch of that child in that step.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use kvmerge_core::{Batch, Error, Merger, MergerConfig, Rule};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyType};

use crate::batch::PyEventBatch;
use crate::convert::type_name;
use crate::errors::{config, PyKvError};
use crate::gil::{is_small, without_gil_unless};
use crate::merger::{raw_and_decoded, PyMergerStats};
use crate::output::{PyWorkerOutput, Read};
use crate::settings::{py_factors, PyWorkerSettings, Settings};
use crate::wire::Part;
use kvmerge_core::EventKind;

/// Declares the kinds of refusal, each once: its variant, its name in
/// Python, and what it means (`_refusal_kinds()`, docs/robustness.md).
macro_rules! refusal_kinds {
    ($($variant:ident => $name:literal, $doc:literal;)*) => {
        /// Why the step refused an output, or one child's part of it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Kind {
            $(#[doc = $doc] $variant,)*
        }

        impl Kind {
            pub const ALL: &'static [Kind] = &[$(Kind::$variant,)*];

            pub fn name(self) -> &'static str {
                match self {
                    $(Kind::$variant => $name,)*
                }
            }

            pub fn doc(self) -> &'static str {
                match self {
                    $(Kind::$variant => $doc,)*
                }
            }
        }
    };
}

refusal_kinds! {
    Output => "output", "Not a worker output, or one whose buffer is damaged.";
    Rank => "rank", "A rank outside the aggregated world.";
    Duplicate => "duplicate", "A second output of one rank in one step.";
    Settings => "settings", "The worker's settings differ from the scheduler's.";
    Misconfigured => "misconfigured", "An output of a rank whose settings differed.";
    Children => "children", "Another number of children than the scheduler's.";
    Encode => "encode", "The worker could not encode or send the child's events.";
    Native => "native", "A native child's container that is no KVConnectorKVEvents, or not of the other ranks' class.";
    Family => "family", "A container family, or mode, this child cannot take.";
    Factors => "factors", "Replication factors that are missing, invalid or disagree.";
    Batch => "batch", "A batch that does not read (damaged in transit).";
    Merge => "merge", "The child's merger refused the batch.";
}

/// One refusal: what, whose (a rank, when known), where (a child, or every
/// child when the whole output was refused), and the detail an operator
/// reads in the log.
#[pyclass(module = "kvmerge._kvmerge", frozen, get_all, name = "Refusal")]
pub struct PyRefusal {
    kind: &'static str,
    rank: Option<i64>,
    child: Option<usize>,
    detail: String,
}

#[pymethods]
impl PyRefusal {
    fn __repr__(&self) -> String {
        format!(
            "Refusal(kind={:?}, rank={:?}, child={:?}, detail={:?})",
            self.kind, self.rank, self.child, self.detail
        )
    }
}

/// What one step gave, per child in config order, and its refusals.
#[pyclass(module = "kvmerge._kvmerge", frozen, get_all, name = "StepResult")]
pub struct PyStepResult {
    step: u64,
    ranks: Vec<i64>,
    events: Py<PyList>,
    removed: Py<PyList>,
    natives: Py<PyList>,
    lost: Vec<Option<String>>,
    refusals: Py<PyList>,
    gaps: Vec<(i64, i64, i64)>,
    expired: u64,
    started: Vec<usize>,
}

/// The rule names a child's setting may hold besides a merger's rules.
const NATIVE: &str = "native";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Merge,
    Native,
}

/// A rule as configured or inferred: a merger's, or native.
fn merged_rule(rule: &str) -> Option<Rule> {
    rule.parse::<Rule>().ok()
}

/// `repr(x)` of Python's values as the log shows them.
fn py_opt_str(value: Option<&str>) -> String {
    value.map_or_else(|| "None".into(), |v| format!("'{v}'"))
}

fn py_opt_factors(value: Option<&[i64]>) -> String {
    value.map_or_else(|| "None".into(), py_factors)
}

/// The settings' names, as `kvmerge.vllm.config` spells them.
#[derive(FromPyObject)]
struct Keys(String, String);

/// One child as the connector configures it: its label, configured rule
/// and factors, whether its events leave as objects, and whether its
/// scheduler has a removal hook.
#[derive(FromPyObject)]
struct ChildArg(String, Option<String>, Option<Vec<i64>>, bool, bool);

struct Child {
    label: String,
    rule: Option<String>,
    factors: Option<Vec<i64>>,
    objects: bool,
    hook: bool,
    mode: Option<Mode>,
    family: Option<String>,
    merger: Option<Merger>,
    merger_rule: Option<Rule>,
    merger_factors: Option<Vec<i64>>,
    factors_from: String,
    /// Whether its merger withholds what no router can apply (the guard).
    guard: bool,
}

/// A refusal before it becomes a Python object.
struct Refused {
    kind: Kind,
    rank: Option<i64>,
    child: Option<usize>,
    detail: String,
}

type Why = (Kind, String);

#[pyclass(module = "kvmerge._kvmerge", name = "OutputMerger")]
pub struct PyOutputMerger {
    world_size: usize,
    max_pending_steps: u64,
    settings: Settings,
    /// Each encoded family this kvmerge knows, and the rule it implies.
    families: HashMap<String, String>,
    keys: Keys,
    native_type: Py<PyType>,
    children: Vec<Child>,
    last_seq: HashMap<i64, i64>,
    misconfigured: Vec<i64>,
    steps: u64,
}

impl Child {
    fn rule_setting(&self, keys: &Keys) -> String {
        match &self.rule {
            Some(rule) => format!("{}='{rule}'", keys.0),
            None => format!(
                "{} (inferred '{}' from a {} container)",
                keys.0,
                self.merger_rule.map_or("?", Rule::name),
                self.family.as_deref().unwrap_or("?")
            ),
        }
    }

    fn make_merger(
        &mut self,
        rule: Rule,
        factors: Option<Vec<i64>>,
        from: String,
        world_size: usize,
        max_pending_steps: u64,
    ) -> Result<(), String> {
        let fail = |e: String| {
            format!(
                "{}: rule '{}' with replication factors {} (from {}): {e}",
                self.label,
                rule.name(),
                py_opt_factors(factors.as_deref()),
                if from.is_empty() { "nowhere" } else { &from }
            )
        };
        let mut cfg = MergerConfig::new(world_size, rule);
        cfg.max_pending_steps = max_pending_steps;
        cfg.carriers.replication_factors = factors
            .as_deref()
            .map(|f| {
                f.iter()
                    .map(|&x| {
                        u32::try_from(x).map_err(|_| format!("replication factor {x} is not a u32"))
                    })
                    .collect::<Result<Vec<u32>, String>>()
            })
            .transpose()
            .map_err(fail)?;
        let merger = Merger::new(cfg)
            .map_err(|e| fail(e.to_string()))?
            .with_guard(self.guard);
        self.merger = Some(merger);
        self.merger_rule = Some(rule);
        self.merger_factors = factors;
        self.factors_from = from;
        Ok(())
    }

    /// Fixes this child's mode, family and merger from a rank's part of
    /// `family` (None: a native container) with the factors it `reported`;
    /// or says why this part cannot join this child. True when it made the
    /// merger.
    fn resolve(
        &mut self,
        family: Option<&str>,
        reported: Option<&[i64]>,
        rule_of: &HashMap<String, String>,
        keys: &Keys,
        world_size: usize,
        max_pending_steps: u64,
    ) -> Result<bool, Why> {
        let named = family.unwrap_or(NATIVE);
        match &self.family {
            None => self.family = Some(named.to_owned()),
            Some(known) if known.as_str() != named => {
                return Err((
                    Kind::Family,
                    format!(
                        "a {named} container, but this child returned {known} containers before"
                    ),
                ))
            }
            Some(_) => {}
        }
        let native = family.is_none();
        match self.mode {
            None => self.mode = Some(if native { Mode::Native } else { Mode::Merge }),
            Some(mode) if native != (mode == Mode::Native) => {
                return Err((
                    Kind::Family,
                    format!(
                        "a {named} {}, but the scheduler's {} setting is {}: workers and \
                         scheduler must share the same kv_transfer_config",
                        if native { "container" } else { "batch" },
                        keys.0,
                        py_opt_str(self.rule.as_deref())
                    ),
                ))
            }
            Some(_) => {}
        }
        if self.mode != Some(Mode::Merge) {
            return Ok(false);
        }
        if self.merger.is_none() {
            let rule = self
                .rule
                .clone()
                .or_else(|| rule_of.get(named).cloned())
                .unwrap_or_else(|| NATIVE.to_owned());
            let Some(rule) = merged_rule(&rule) else {
                return Err((
                    Kind::Family,
                    format!(
                        "a {named} batch, but the scheduler infers {}='{rule}' for a {named} \
                         container: workers and scheduler must share the same kv_transfer_config",
                        keys.0
                    ),
                ));
            };
            let (mut factors, mut from) = (self.factors.clone(), keys.1.clone());
            if rule == Rule::Quorum && factors.is_none() {
                factors = reported.map(<[i64]>::to_vec);
                from = format!("the {named} container");
                if factors.is_none() {
                    return Err((
                        Kind::Factors,
                        format!(
                            "{}='quorum' needs replication factors, one per KV cache group: set \
                             {} in this child's kv_connector_extra_config (its containers carry \
                             none)",
                            keys.0, keys.1
                        ),
                    ));
                }
            }
            self.make_merger(rule, factors, from, world_size, max_pending_steps)
                .map_err(|e| (Kind::Factors, e))?;
            return Ok(true);
        }
        if let (Some(Rule::Quorum), Some(reported)) = (self.merger_rule, reported) {
            if self.factors_from != keys.1 && Some(reported) != self.merger_factors.as_deref() {
                return Err((
                    Kind::Factors,
                    format!(
                        "replication factors {}, others {}; set {} to choose",
                        py_factors(reported),
                        py_opt_factors(self.merger_factors.as_deref()),
                        keys.1
                    ),
                ));
            }
        }
        Ok(false)
    }

    /// Why the merger refused a batch, as the log says it.
    fn explain(&self, py: Python<'_>, e: Error, keys: &Keys) -> String {
        if let Error::GroupOutOfRange { .. } = e {
            return format!(
                "{} with replication factors {} (from {}) does not cover its KV cache group: {e}",
                self.rule_setting(keys),
                py_opt_factors(self.merger_factors.as_deref()),
                self.factors_from
            );
        }
        error_text(py, e)
    }
}

/// `"{class}: {message}"` of the Python exception a core error raises.
fn error_text(py: Python<'_>, e: Error) -> String {
    py_error_text(py, &PyErr::from(PyKvError(e)))
}

fn empty() -> Arc<Batch> {
    static EMPTY: OnceLock<Arc<Batch>> = OnceLock::new();
    EMPTY.get_or_init(|| Arc::new(Batch::empty())).clone()
}

/// An output that passed the output-level checks.
struct Accepted<'a> {
    rank: i64,
    output: &'a PyWorkerOutput,
    read: &'a Read,
}

impl PyOutputMerger {
    /// The output-level checks of one output (`seen`: the rank and `seq` of
    /// each output accepted so far this step; `misconfigured`: this step's
    /// view of the ranks whose settings differ, the one thing it changes).
    fn check_output<'a>(
        &self,
        item: &'a Bound<'_, PyAny>,
        seen: &[(i64, i64)],
        misconfigured: &mut Vec<i64>,
    ) -> PyResult<Result<Accepted<'a>, Refused>> {
        let refuse = |kind, rank, detail| {
            Ok(Err(Refused {
                kind,
                rank,
                child: None,
                detail,
            }))
        };
        let Ok(output) = item.cast_exact::<PyWorkerOutput>() else {
            return refuse(
                Kind::Output,
                None,
                format!("not a WorkerOutput but {}", type_name(item)),
            );
        };
        let output: &'a PyWorkerOutput = output.get();
        let read = match output.read() {
            Ok(read) => read,
            Err(damage) => {
                return refuse(
                    Kind::Output,
                    damage.rank,
                    format!("the worker output is damaged: {}", damage.why),
                )
            }
        };
        let rank = read.header.rank;
        if usize::try_from(rank).map_or(true, |r| r >= self.world_size) {
            return refuse(
                Kind::Rank,
                Some(rank),
                format!(
                    "rank {rank} is outside the aggregated world of {}",
                    self.world_size
                ),
            );
        }
        if seen.iter().any(|&(r, _)| r == rank) {
            return refuse(
                Kind::Duplicate,
                Some(rank),
                format!(
                    "a second output claims rank {rank} in one step (two workers with one \
                     rank? vLLM's salvaged outputs carry no KV events)"
                ),
            );
        }
        if let Some(theirs) = &read.header.settings {
            let differ = self.settings.differences(theirs, rank);
            if !differ.is_empty() {
                if self.steps == 0 {
                    // Start-up: misconfiguration stops the engine, loudly.
                    return Err(config(
                        item.py(),
                        format!(
                            "KVMergeMultiConnector: rank {rank}'s settings differ from the \
                             scheduler's: {}",
                            differ.join("; ")
                        ),
                    ));
                }
                if !misconfigured.contains(&rank) {
                    misconfigured.push(rank);
                }
                return refuse(Kind::Settings, Some(rank), differ.join("; "));
            }
            misconfigured.retain(|&r| r != rank);
        }
        if misconfigured.contains(&rank) {
            return refuse(
                Kind::Misconfigured,
                Some(rank),
                "its settings differ from the scheduler's (logged at its start)".into(),
            );
        }
        let n = read.header.parts.len();
        if n != self.children.len() {
            return refuse(
                Kind::Children,
                Some(rank),
                format!(
                    "{n} children for {} connectors: workers and scheduler must share the \
                     same kv_transfer_config",
                    self.children.len()
                ),
            );
        }
        Ok(Ok(Accepted { rank, output, read }))
    }

    /// Child `index`'s part of `a`: the batch to add (the empty batch for a
    /// child that returned nothing, and for a native container, which goes
    /// to `natives`), and whether taking it made the child's merger; or why
    /// it is refused.
    fn take_part(
        &mut self,
        py: Python<'_>,
        index: usize,
        a: &Accepted<'_>,
        natives: &mut Vec<(i64, Py<PyAny>)>,
    ) -> Result<(Arc<Batch>, bool), Why> {
        let (families, keys) = (&self.families, &self.keys);
        let (world_size, max_pending) = (self.world_size, self.max_pending_steps);
        let child = &mut self.children[index];
        match &a.read.header.parts[index] {
            Part::Nothing => Ok((empty(), false)),
            Part::Refused(reason) => {
                let reason = String::from_utf8_lossy(a.read.bytes(reason));
                let cut: String = reason.chars().take(500).collect();
                Err((
                    Kind::Encode,
                    format!("the worker could not encode it: {cut}"),
                ))
            }
            Part::Native => {
                let native_type = self.native_type.bind(py);
                let container = a.output.native(py, index);
                let Some(container) =
                    container.filter(|c| c.is_instance(native_type).unwrap_or(false))
                else {
                    let found = a
                        .output
                        .native(py, index)
                        .map_or_else(|| "NoneType".to_owned(), |c| type_name(&c));
                    return Err((
                        Kind::Native,
                        format!("a native child's container is a {found}"),
                    ));
                };
                // The child combines the step's containers into the first
                // one (`kvmerge.vllm.native`), as vLLM's aggregator does:
                // each must be of a class the first is an instance of.
                if let Some((_, first)) = natives.first() {
                    let first = first.bind(py);
                    if !first.is_instance(&container.get_type()).unwrap_or(false) {
                        return Err((
                            Kind::Native,
                            format!(
                                "a {} container, where other ranks sent {} containers",
                                type_name(&container),
                                type_name(first)
                            ),
                        ));
                    }
                }
                child.resolve(None, None, families, keys, world_size, max_pending)?;
                natives.push((a.rank, container.unbind()));
                Ok((empty(), false))
            }
            Part::Batch {
                family,
                factors,
                batch,
            } => {
                let family = String::from_utf8_lossy(a.read.bytes(family));
                if !families.contains_key(family.as_ref()) {
                    let cut: String = family.chars().take(50).collect();
                    return Err((Kind::Family, format!("an unknown container family '{cut}'")));
                }
                if let Some(f) = factors {
                    if f.iter().any(|&x| x < 1) {
                        return Err((
                            Kind::Factors,
                            format!(
                                "replication factors {} are not positive ints",
                                py_factors(f)
                            ),
                        ));
                    }
                }
                let batch = a.read.batch(py, batch).map_err(|why| (Kind::Batch, why))?;
                let started = child.resolve(
                    Some(&family),
                    factors.as_deref(),
                    families,
                    keys,
                    world_size,
                    max_pending,
                )?;
                Ok((Arc::new(batch), started))
            }
        }
    }

    /// Adds the step's batches of child `index` to its merger, one rank at
    /// a time (each add checks everything first: a refused batch changes
    /// nothing), and finishes its step.
    fn merge_child(
        &mut self,
        py: Python<'_>,
        index: usize,
        adds: Vec<(i64, Arc<Batch>)>,
        refused: &mut Vec<Refused>,
    ) -> PyResult<ChildOut> {
        let keys = &self.keys;
        let child = &mut self.children[index];
        let Some(merger) = child.merger.as_mut() else {
            return Ok(ChildOut::default());
        };
        let mut rejected = Vec::new();
        for (rank, batch) in adds {
            let small = is_small(0, batch.len() as u64);
            if let Err(e) = without_gil_unless(py, small, || merger.add(rank, batch)) {
                rejected.push((rank, e));
            }
        }
        let (bytes, reports) = merger.load();
        let small = is_small(bytes, reports);
        let objects = child.objects;
        let kind = (child.hook && !objects).then_some(EventKind::BlockRemoved);
        let finished = if objects {
            let batch = without_gil_unless(py, small, || merger.finish_step());
            let batch = Bound::new(py, PyEventBatch::new(batch))?;
            PyEventBatch::decode(&batch).map(|events| (events, None))
        } else {
            let published = without_gil_unless(py, small, || merger.finish_step_published());
            raw_and_decoded(py, &published, kind)
                .map(|(raws, removed)| (raws.into_any(), kind.map(|_| removed)))
        };
        for (rank, e) in rejected {
            refused.push(Refused {
                kind: Kind::Merge,
                rank: Some(rank),
                child: Some(index),
                detail: child.explain(py, e, keys),
            });
        }
        Ok(match finished {
            Ok((events, removed)) => ChildOut {
                events: Some(events.unbind()),
                removed: removed.map(Bound::unbind),
                lost: None,
            },
            // Merged, but the events do not decode (a forged removal for
            // the hook): the step's output is lost, counted and logged.
            Err(e) => ChildOut {
                events: None,
                removed: None,
                lost: Some(py_error_text(py, &e)),
            },
        })
    }

    fn expired(&self) -> u64 {
        self.children
            .iter()
            .filter_map(|c| c.merger.as_ref())
            .map(|m| m.stats().expired)
            .sum()
    }
}

#[derive(Default)]
struct ChildOut {
    events: Option<Py<PyAny>>,
    removed: Option<Py<PyAny>>,
    lost: Option<String>,
}

/// `"{class}: {message}"` of a Python exception.
fn py_error_text(py: Python<'_>, e: &PyErr) -> String {
    let class = e
        .get_type(py)
        .name()
        .map_or_else(|_| "Exception".to_owned(), |n| n.to_string());
    format!("{class}: {}", e.value(py))
}

// The Python-facing docs are in _kvmerge.pyi; comments here say why.
#[pymethods]
impl PyOutputMerger {
    #[new]
    #[pyo3(signature = (world_size, max_pending_steps, settings, families, children, native_type, keys, guard = true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        world_size: usize,
        max_pending_steps: u64,
        settings: &Bound<'_, PyWorkerSettings>,
        families: HashMap<String, String>,
        children: Vec<ChildArg>,
        native_type: Bound<'_, PyType>,
        keys: Keys,
        guard: bool,
    ) -> PyResult<Self> {
        let mut built = Vec::with_capacity(children.len());
        for ChildArg(label, rule, factors, objects, hook) in children {
            let mut child = Child {
                label,
                rule: rule.clone(),
                factors: factors.clone(),
                objects,
                hook,
                mode: None,
                family: None,
                merger: None,
                merger_rule: None,
                merger_factors: None,
                factors_from: String::new(),
                guard,
            };
            match rule.as_deref() {
                Some(NATIVE) => child.mode = Some(Mode::Native),
                Some(name) => {
                    let Some(merged) = merged_rule(name) else {
                        return Err(config(
                            py,
                            format!("{}: {}='{name}' is not a merge rule", child.label, keys.0),
                        ));
                    };
                    child.mode = Some(Mode::Merge);
                    if merged != Rule::Quorum || factors.is_some() {
                        child
                            .make_merger(
                                merged,
                                factors,
                                keys.1.clone(),
                                world_size,
                                max_pending_steps,
                            )
                            .map_err(|e| config(py, e))?;
                    }
                }
                None => {}
            }
            built.push(child);
        }
        Ok(PyOutputMerger {
            world_size,
            max_pending_steps,
            settings: settings.get().0.clone(),
            families,
            keys,
            native_type: native_type.unbind(),
            children: built,
            last_seq: HashMap::new(),
            misconfigured: Vec::new(),
            steps: 0,
        })
    }

    fn step(&mut self, py: Python<'_>, outputs: Vec<Bound<'_, PyAny>>) -> PyResult<PyStepResult> {
        let mut refused: Vec<Refused> = Vec::new();
        let mut misconfigured = self.misconfigured.clone();
        let mut accepted: Vec<Accepted<'_>> = Vec::with_capacity(outputs.len());
        let mut gaps = Vec::new();
        let mut seqs: Vec<(i64, i64)> = Vec::with_capacity(outputs.len());
        for item in &outputs {
            match self.check_output(item, &seqs, &mut misconfigured)? {
                Err(r) => refused.push(r),
                Ok(a) => {
                    let seq = a.read.header.seq;
                    if let Some(&last) = self.last_seq.get(&a.rank) {
                        if seq > last.saturating_add(1) {
                            gaps.push((a.rank, last + 1, seq - 1));
                        }
                    }
                    seqs.push((a.rank, seq));
                    accepted.push(a);
                }
            }
        }
        // Nothing changed before here: a start-up ConfigError leaves all as it was.
        self.misconfigured = misconfigured;
        self.last_seq.extend(seqs);
        accepted.sort_by_key(|a| a.rank);
        let expired_before = self.expired();
        let n = self.children.len();
        let ranks: Vec<i64> = accepted.iter().map(|a| a.rank).collect();
        let mut events: Vec<Option<Py<PyAny>>> = Vec::with_capacity(n);
        let mut removed: Vec<Option<Py<PyAny>>> = Vec::with_capacity(n);
        let mut natives_of: Vec<Option<Py<PyList>>> = Vec::with_capacity(n);
        let mut lost = Vec::with_capacity(n);
        let mut started = Vec::new();
        for index in 0..n {
            let mut adds = Vec::with_capacity(accepted.len());
            let mut natives = Vec::new();
            for a in &accepted {
                match self.take_part(py, index, a, &mut natives) {
                    Ok((batch, made)) => {
                        if made {
                            started.push(index);
                        }
                        adds.push((a.rank, batch));
                    }
                    Err((kind, detail)) => {
                        refused.push(Refused {
                            kind,
                            rank: Some(a.rank),
                            child: Some(index),
                            detail,
                        });
                        adds.push((a.rank, empty()));
                    }
                }
            }
            if self.children[index].mode == Some(Mode::Native) {
                natives_of.push(Some(PyList::new(py, natives)?.unbind()));
                events.push(None);
                removed.push(None);
                lost.push(None);
                continue;
            }
            natives_of.push(None);
            let child = self.merge_child(py, index, adds, &mut refused)?;
            events.push(child.events);
            removed.push(child.removed);
            lost.push(child.lost);
        }
        let expired = self.expired() - expired_before;
        let refusals = refused
            .into_iter()
            .map(|r| {
                Py::new(
                    py,
                    PyRefusal {
                        kind: r.kind.name(),
                        rank: r.rank,
                        child: r.child,
                        detail: r.detail,
                    },
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        let step = self.steps;
        self.steps += 1;
        Ok(PyStepResult {
            step,
            ranks,
            events: PyList::new(py, events)?.unbind(),
            removed: PyList::new(py, removed)?.unbind(),
            natives: PyList::new(py, natives_of)?.unbind(),
            lost,
            refusals: PyList::new(py, refusals)?.unbind(),
            gaps,
            expired,
            started,
        })
    }

    #[getter]
    fn steps(&self) -> u64 {
        self.steps
    }

    fn stats(&self) -> Vec<Option<PyMergerStats>> {
        self.children
            .iter()
            .map(|c| c.merger.as_ref().map(|m| PyMergerStats::from(m.stats())))
            .collect()
    }

    fn describe(&self, index: usize) -> Option<String> {
        let child = self.children.get(index)?;
        let merger = child.merger.as_ref()?;
        Some(format!(
            "rule '{}', replication factors {} (from {}), world size {}, max_pending_steps {}",
            child.merger_rule.map_or("?", Rule::name),
            py_opt_factors(child.merger_factors.as_deref()),
            if child.factors_from.is_empty() {
                "none"
            } else {
                &child.factors_from
            },
            merger.config().carriers.world_size,
            merger.config().max_pending_steps
        ))
    }

    fn reset(&mut self) {
        for merger in self.children.iter_mut().filter_map(|c| c.merger.as_mut()) {
            merger.reset();
        }
    }
}

/// Every refusal kind, `(name, meaning)`, in declaration order.
#[pyfunction]
pub fn _refusal_kinds() -> Vec<(&'static str, &'static str)> {
    Kind::ALL.iter().map(|k| (k.name(), k.doc())).collect()
}
