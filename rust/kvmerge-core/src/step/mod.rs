//! The scheduler's step of `KVMergeMultiConnector`: every check of a step's
//! worker outputs and every merge of it, here and nowhere else.
//!
//! `OutputMerger` holds what the step needs across steps: each rank's last
//! `seq` and whether its settings differed, and each child's `State`. A step
//! runs in two phases, so that the binding holds the GIL only where Python
//! values are read: `take` checks each output and each child's part of it
//! once, through `Outputs` (the binding's view of the outputs it received),
//! and `merge` adds what passed to the children's mergers and finishes
//! their step, with no Python anywhere. A refused part costs only itself:
//! that rank's part of that child in that step.

pub mod child;
pub mod refusal;
pub mod repr;
pub mod settings;
pub mod wire;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

use crate::batch::Batch;
use crate::merge::{Published, Stats};

pub use child::{
    Child, ChildConfig, ChildRule, ConfigFault, Limits, Plan, PlanFault, Source, State,
    FACTORS_KEY, MERGE_KEY,
};
pub use refusal::{Kind, Refusal, Why};
pub use settings::{ChildSettings, Settings};
pub use wire::{Damage, Header, Part};

/// One step's worker outputs as the binding received them.
pub trait Outputs {
    /// A native child's container, as the binding holds it.
    type Native;

    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Output `i`'s header, or why it is no output.
    fn header(&self, i: usize) -> Result<&Header, Damage>;

    /// The bytes at `range` of output `i`'s buffer.
    fn bytes(&self, i: usize, range: &Range<usize>) -> &[u8];

    /// The batch at `range` of output `i`'s buffer, validated.
    fn batch(&self, i: usize, range: &Range<usize>) -> Result<Batch, String>;

    /// Child `child`'s container beside output `i`, or what is there
    /// instead when it is no container a native child takes.
    fn native(&self, i: usize, child: usize) -> Result<Self::Native, String>;

    /// Why `later` cannot be combined into `first`, if it cannot.
    fn joins(&self, first: &Self::Native, later: &Self::Native) -> Result<(), String>;
}

/// What the step is built with (`KVMergeMultiConnector`'s settings).
pub struct StepConfig {
    /// What every worker should believe (rank aside: -1).
    pub settings: Settings,
    pub max_pending_steps: u64,
    /// Each container family a worker may encode, and the rule it implies.
    pub families: HashMap<String, ChildRule>,
    /// Whether the mergers withhold what no router can apply.
    pub guard: bool,
}

/// Why the step cannot go on: a misconfiguration found at start-up (in the
/// constructor, or in the first step's settings). Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Misconfigured(pub String);

/// A rank's outputs that never arrived: `(rank, first seq, last seq)`.
pub type Gap = (i64, i64, i64);

/// A child's part of the step between the phases.
enum Taken {
    Native,
    Merge(Vec<(i64, Arc<Batch>)>),
}

/// A step after `take`: what `merge` adds, and what was found so far
/// (Python-free: it crosses to where the GIL is released).
pub struct Took {
    step: u64,
    ranks: Vec<i64>,
    gaps: Vec<Gap>,
    /// Refusals of whole outputs.
    refused: Vec<Refusal>,
    children: Vec<(Taken, Vec<Refusal>, bool)>,
    load: (u64, u64),
}

impl Took {
    /// The bytes and reports `merge` works through: to decide whether it
    /// is worth releasing the GIL for.
    pub fn load(&self) -> (u64, u64) {
        self.load
    }
}

/// What one step gave a child.
pub enum Outcome {
    /// No merger yet: nothing to publish.
    Idle,
    /// A native child: its containers (`take`'s natives) pass through.
    Native,
    /// The events that became complete this step, in publication order.
    Merged(Published),
}

/// One child's step.
pub struct ChildStep {
    pub outcome: Outcome,
    /// Whether this step made its merger (the log says how it merges).
    pub started: bool,
}

/// What one step gave, per child in config order, and its refusals.
pub struct Step {
    /// The step's number, in every line and metric about it.
    pub step: u64,
    /// The ranks whose outputs were taken, in order.
    pub ranks: Vec<i64>,
    pub children: Vec<ChildStep>,
    /// Whole outputs first, then child by child.
    pub refusals: Vec<Refusal>,
    pub gaps: Vec<Gap>,
    /// Reports that expired in this step, over all children.
    pub expired: u64,
}

/// The scheduler's step: see the module's docs.
pub struct OutputMerger {
    settings: Settings,
    world_size: usize,
    limits: Limits,
    families: HashMap<String, ChildRule>,
    children: Vec<Child>,
    last_seq: HashMap<i64, i64>,
    misconfigured: Vec<i64>,
    steps: u64,
}

fn empty() -> Arc<Batch> {
    static EMPTY: OnceLock<Arc<Batch>> = OnceLock::new();
    EMPTY.get_or_init(|| Arc::new(Batch::empty())).clone()
}

/// An output that passed the output-level checks: its index and rank.
struct Accepted {
    index: usize,
    rank: i64,
}

impl OutputMerger {
    /// The step for `config`: each child's configuration checked, and its
    /// merger made where the configuration needs no container.
    pub fn new(config: StepConfig) -> Result<OutputMerger, Misconfigured> {
        let settings = config.settings;
        let world_size = usize::try_from(settings.world_size)
            .ok()
            .filter(|&w| w >= 1)
            .ok_or_else(|| {
                Misconfigured(format!("world size {} is not >= 1", settings.world_size))
            })?;
        let limits = Limits {
            world_size,
            max_pending_steps: config.max_pending_steps,
            guard: config.guard,
        };
        let children = settings
            .children
            .iter()
            .map(|c| {
                let child = ChildConfig::new(c.rule.as_deref(), c.factors.as_deref())
                    .map_err(|fault| Misconfigured(format!("{}: {fault}", c.label)))?;
                Child::new(c.label.clone(), child, limits).map_err(Misconfigured)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(OutputMerger {
            settings,
            world_size,
            limits,
            families: config.families,
            children,
            last_seq: HashMap::new(),
            misconfigured: Vec::new(),
            steps: 0,
        })
    }

    /// Steps run so far: the next step's number.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn children(&self) -> &[Child] {
        &self.children
    }

    /// Per child, its merger's counters (None: no merger).
    pub fn stats(&self) -> Vec<Option<Stats>> {
        self.children
            .iter()
            .map(|c| c.merging().map(|m| m.merger.stats()))
            .collect()
    }

    /// Forgets every pending report (vLLM's reset of the prefix cache).
    pub fn reset(&mut self) {
        for merger in self.children.iter_mut().filter_map(Child::merger_mut) {
            merger.reset();
        }
    }

    fn expired(&self) -> u64 {
        self.stats().iter().flatten().map(|s| s.expired).sum()
    }

    /// The output-level checks of output `i` (`seen`: the rank and `seq`
    /// of each output accepted so far this step; `misconfigured`: this
    /// step's view of the ranks whose settings differ).
    fn check_output<O: Outputs>(
        &self,
        outputs: &O,
        i: usize,
        seen: &[(i64, i64)],
        misconfigured: &mut Vec<i64>,
    ) -> Result<Result<Accepted, Refusal>, Misconfigured> {
        let refuse = |kind, rank, detail| {
            Ok(Err(Refusal {
                kind,
                rank,
                child: None,
                detail,
            }))
        };
        let header = match outputs.header(i) {
            Ok(header) => header,
            Err(damage) => return refuse(Kind::Output, damage.rank, damage.why),
        };
        let rank = header.rank;
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
        if let Some(theirs) = &header.settings {
            let differ = self.settings.differences(theirs, rank);
            if !differ.is_empty() {
                if self.steps == 0 {
                    // Start-up: misconfiguration stops the engine, loudly.
                    return Err(Misconfigured(format!(
                        "KVMergeMultiConnector: rank {rank}'s settings differ from the \
                         scheduler's: {}",
                        differ.join("; ")
                    )));
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
        let n = header.parts.len();
        if n != self.children.len() {
            return refuse(
                Kind::Children,
                Some(rank),
                format!(
                    "{n} children for {} connectors: {}",
                    self.children.len(),
                    "workers and scheduler must share the same kv_transfer_config"
                ),
            );
        }
        Ok(Ok(Accepted { index: i, rank }))
    }

    /// Child `index`'s part of output `a`: the batch to add (the empty
    /// batch for a child that returned nothing, and for a native container,
    /// which goes to `natives`), and whether taking it made the merger.
    fn take_part<O: Outputs>(
        &mut self,
        outputs: &O,
        index: usize,
        a: &Accepted,
        natives: &mut Vec<(i64, O::Native)>,
    ) -> Result<(Arc<Batch>, bool), Why> {
        let header = outputs
            .header(a.index)
            .expect("an accepted output has a header");
        let limits = self.limits;
        let child = &mut self.children[index];
        match &header.parts[index] {
            Part::Nothing => Ok((empty(), false)),
            Part::Refused(reason) => {
                let reason = String::from_utf8_lossy(outputs.bytes(a.index, reason));
                let cut: String = reason.chars().take(500).collect();
                Err((
                    Kind::Encode,
                    format!("the worker could not encode it: {cut}"),
                ))
            }
            Part::Native => {
                let container = outputs.native(a.index, index).map_err(|found| {
                    (
                        Kind::Native,
                        format!("a native child's container is a {found}"),
                    )
                })?;
                // The child combines the step's containers into the first
                // one (`kvmerge.vllm.native`), as vLLM's aggregator does.
                if let Some((_, first)) = natives.first() {
                    outputs
                        .joins(first, &container)
                        .map_err(|why| (Kind::Native, why))?;
                }
                child.take_native()?;
                natives.push((a.rank, container));
                Ok((empty(), false))
            }
            Part::Batch {
                family,
                factors,
                batch,
            } => {
                let family = String::from_utf8_lossy(outputs.bytes(a.index, family));
                let Some(&implied) = self.families.get(family.as_ref()) else {
                    let cut: String = family.chars().take(50).collect();
                    return Err((Kind::Family, format!("an unknown container family '{cut}'")));
                };
                let batch = outputs
                    .batch(a.index, batch)
                    .map_err(|why| (Kind::Batch, why))?;
                let made = child.take_batch(&family, implied, factors.as_deref(), limits)?;
                Ok((Arc::new(batch), made))
            }
        }
    }

    /// The first phase of a step: every check of `outputs`, each child's
    /// state advanced; and per child the native containers it took, by
    /// rank (empty but for native children). A misconfiguration at
    /// start-up changes nothing.
    #[allow(clippy::type_complexity)]
    pub fn take<O: Outputs>(
        &mut self,
        outputs: &O,
    ) -> Result<(Took, Vec<Vec<(i64, O::Native)>>), Misconfigured> {
        let mut refused = Vec::new();
        let mut misconfigured = self.misconfigured.clone();
        let mut accepted: Vec<Accepted> = Vec::with_capacity(outputs.len());
        let mut gaps = Vec::new();
        let mut seqs: Vec<(i64, i64)> = Vec::with_capacity(outputs.len());
        for i in 0..outputs.len() {
            match self.check_output(outputs, i, &seqs, &mut misconfigured)? {
                Err(r) => refused.push(r),
                Ok(a) => {
                    let seq = outputs.header(i).expect("accepted").seq;
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
        self.misconfigured = misconfigured;
        self.last_seq.extend(seqs);
        accepted.sort_by_key(|a| a.rank);
        let mut load = (0u64, 0u64);
        let mut children = Vec::with_capacity(self.children.len());
        let mut natives_of = Vec::with_capacity(self.children.len());
        for index in 0..self.children.len() {
            let mut adds = Vec::with_capacity(accepted.len());
            let mut natives = Vec::new();
            let mut refusals = Vec::new();
            let mut started = false;
            for a in &accepted {
                match self.take_part(outputs, index, a, &mut natives) {
                    Ok((batch, made)) => {
                        started |= made;
                        load.0 += batch.carried_len() as u64;
                        load.1 += batch.len() as u64;
                        adds.push((a.rank, batch));
                    }
                    Err((kind, detail)) => {
                        refusals.push(Refusal {
                            kind,
                            rank: Some(a.rank),
                            child: Some(index),
                            detail,
                        });
                        adds.push((a.rank, empty()));
                    }
                }
            }
            let child = &self.children[index];
            if let Some(m) = child.merging() {
                let (bytes, reports) = m.merger.load();
                load = (load.0 + bytes, load.1 + reports);
            }
            let taken = if child.is_native() {
                Taken::Native
            } else {
                Taken::Merge(adds)
            };
            children.push((taken, refusals, started));
            natives_of.push(natives);
        }
        let took = Took {
            step: self.steps,
            ranks: accepted.iter().map(|a| a.rank).collect(),
            gaps,
            refused,
            children,
            load,
        };
        Ok((took, natives_of))
    }

    /// The second phase: each merging child's batches added to its merger,
    /// one rank at a time (each add checks everything first: a refused
    /// batch changes nothing), and its step finished. No Python here.
    pub fn merge(&mut self, took: Took) -> Step {
        let expired_before = self.expired();
        let mut refusals = took.refused;
        let mut children = Vec::with_capacity(took.children.len());
        for (index, (taken, refused, started)) in took.children.into_iter().enumerate() {
            refusals.extend(refused);
            let child = &mut self.children[index];
            let outcome = match taken {
                Taken::Native => Outcome::Native,
                Taken::Merge(adds) => match child.merger_mut() {
                    None => Outcome::Idle,
                    Some(merger) => {
                        let mut rejected = Vec::new();
                        for (rank, batch) in adds {
                            if let Err(e) = merger.add(rank, batch) {
                                rejected.push((rank, e));
                            }
                        }
                        let published = merger.finish_step_published();
                        rejected.extend(merger.take_refused());
                        refusals.extend(rejected.into_iter().map(|(rank, e)| Refusal {
                            kind: Kind::Merge,
                            rank: Some(rank),
                            child: Some(index),
                            detail: child.explain(&e),
                        }));
                        Outcome::Merged(published)
                    }
                },
            };
            children.push(ChildStep { outcome, started });
        }
        let expired = self.expired() - expired_before;
        self.steps += 1;
        Step {
            step: took.step,
            ranks: took.ranks,
            children,
            refusals,
            gaps: took.gaps,
            expired,
        }
    }
}

#[cfg(test)]
mod tests;
