//! One child of the `MultiConnector`: what its configuration says
//! (`ChildConfig`, checked once, here), how it merges once a family is
//! known (`Plan`), and where it stands across steps (`State`).
//!
//! Both sides decide with this code: the worker, which encodes a child's
//! events for the rule the scheduler's merger applies, and the scheduler.

use std::fmt;

use crate::merge::{Merger, MergerConfig};
use crate::rule::Rule;

use super::refusal::{Kind, Why};
use super::repr::py_factors;

/// The key of a child's rule in its `kv_connector_extra_config`.
pub const MERGE_KEY: &str = "kv_events_merge";
/// The key of a child's replication factors (rule "quorum").
pub const FACTORS_KEY: &str = "kv_events_replication_factors";

/// A child's rule: a merger's, or "native" (its own container and methods).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildRule {
    Native,
    Merge(Rule),
}

impl ChildRule {
    /// Every rule a child may be given, in the order the docs list them.
    pub const ALL: [ChildRule; 4] = [
        ChildRule::Merge(Rule::All),
        ChildRule::Merge(Rule::Quorum),
        ChildRule::Merge(Rule::Any),
        ChildRule::Native,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ChildRule::Native => "native",
            ChildRule::Merge(rule) => rule.name(),
        }
    }

    pub fn parse(name: &str) -> Option<ChildRule> {
        ChildRule::ALL.into_iter().find(|r| r.name() == name)
    }
}

/// Why a child's configuration cannot work: found at start-up, on both
/// sides, before any child is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigFault {
    /// The rule setting names no rule (as written).
    Rule(String),
    /// The factors setting is no non-empty list of integers >= 1 (as written).
    Factors(String),
    /// Factors set for a rule that uses none.
    Unused(ChildRule),
}

impl fmt::Display for ConfigFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigFault::Rule(written) => {
                let names: Vec<String> = ChildRule::ALL
                    .iter()
                    .map(|r| format!("'{}'", r.name()))
                    .collect();
                write!(
                    f,
                    "{MERGE_KEY}={written} is not a merge rule; use one of {}",
                    names.join(", ")
                )
            }
            ConfigFault::Factors(written) => write!(
                f,
                "{FACTORS_KEY}={written} must be a non-empty list of integers >= 1, one per \
                 KV cache group"
            ),
            ConfigFault::Unused(rule) => write!(
                f,
                "{FACTORS_KEY} is only used by {MERGE_KEY}='quorum', not {MERGE_KEY}='{}'",
                rule.name()
            ),
        }
    }
}

impl std::error::Error for ConfigFault {}

/// A child's configured rule (None: inferred from its container's family)
/// and replication factors, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildConfig {
    rule: Option<ChildRule>,
    factors: Option<Vec<u32>>,
}

/// `factors` as the settings and the log write them.
fn written(factors: &[i64]) -> String {
    let items: Vec<String> = factors.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// Factors as a merger takes them: a non-empty list of u32 >= 1.
fn checked(factors: &[i64]) -> Option<Vec<u32>> {
    if factors.is_empty() {
        return None;
    }
    factors
        .iter()
        .map(|&f| u32::try_from(f).ok().filter(|&f| f >= 1))
        .collect()
}

impl ChildConfig {
    /// The configuration of a child whose settings say `rule` and
    /// `factors`, as its `kv_connector_extra_config` holds them.
    pub fn new(rule: Option<&str>, factors: Option<&[i64]>) -> Result<Self, ConfigFault> {
        let rule = rule
            .map(|name| {
                ChildRule::parse(name).ok_or_else(|| ConfigFault::Rule(format!("'{name}'")))
            })
            .transpose()?;
        let factors = factors
            .map(|f| checked(f).ok_or_else(|| ConfigFault::Factors(written(f))))
            .transpose()?;
        if let (Some(rule), Some(_)) = (rule, &factors) {
            if rule != ChildRule::Merge(Rule::Quorum) {
                return Err(ConfigFault::Unused(rule));
            }
        }
        Ok(ChildConfig { rule, factors })
    }

    pub fn rule(&self) -> Option<ChildRule> {
        self.rule
    }

    pub fn factors(&self) -> Option<&[u32]> {
        self.factors.as_deref()
    }

    /// The rule for a container whose family implies `implied`: the
    /// configured one wins.
    pub fn rule_for(&self, implied: ChildRule) -> ChildRule {
        self.rule.unwrap_or(implied)
    }

    /// How this child merges a container whose family implies `implied`
    /// and which reported `reported` factors. Configured factors win over
    /// reported ones; only "quorum" uses factors.
    pub fn plan(&self, implied: ChildRule, reported: Option<&[i64]>) -> Result<Plan, PlanFault> {
        let ChildRule::Merge(rule) = self.rule_for(implied) else {
            return Err(PlanFault::Native);
        };
        let (factors, source) = match (rule, &self.factors, reported) {
            (Rule::Quorum, Some(f), _) => (Some(f.clone()), Source::Config),
            (Rule::Quorum, None, Some(r)) => (
                Some(checked(r).ok_or_else(|| PlanFault::Factors(r.to_vec()))?),
                Source::Container,
            ),
            (Rule::Quorum, None, None) => return Err(PlanFault::NoFactors),
            _ => (None, Source::Nowhere),
        };
        Ok(Plan {
            rule,
            factors,
            source,
        })
    }

    /// A merger's plan that needs no container: the configured rule, when
    /// it is a merger's and has the factors it needs.
    fn configured_plan(&self) -> Option<Plan> {
        match self.rule? {
            ChildRule::Native => None,
            ChildRule::Merge(_) => self.plan(ChildRule::Native, None).ok(),
        }
    }
}

/// Where a merger's replication factors came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The rule uses none.
    Nowhere,
    /// The child's `kv_events_replication_factors`.
    Config,
    /// The first container the scheduler merged.
    Container,
}

/// How a child merges: its rule and factors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub rule: Rule,
    pub factors: Option<Vec<u32>>,
    pub source: Source,
}

/// Why no merger can take a child's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanFault {
    /// Its rule is "native".
    Native,
    /// "quorum", and neither the configuration nor the container has factors.
    NoFactors,
    /// "quorum", and the container's factors are not integers >= 1.
    Factors(Vec<i64>),
}

/// A child's merger and the plan it was made from.
pub struct Merging {
    pub plan: Plan,
    pub merger: Merger,
}

/// Where a child stands across steps.
pub enum State {
    /// No rule configured and no part taken yet: the first decides.
    Unresolved,
    /// Its containers pass through; `seen` once one came.
    Native { seen: bool },
    /// Merged: `family` fixed by its first batch, `merging` once the
    /// factors are known (a configured "quorum" without factors waits for
    /// its first container's).
    Merge {
        family: Option<String>,
        merging: Option<Box<Merging>>,
    },
}

/// What a child's merger is made with besides its plan.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub world_size: usize,
    pub max_pending_steps: u64,
    pub guard: bool,
}

/// One child: its label, configuration and state.
pub struct Child {
    pub label: String,
    pub config: ChildConfig,
    pub state: State,
}

impl Child {
    /// A child as configured: a merger made now when its configuration
    /// needs no container (or why it cannot be made: a start-up error).
    pub fn new(label: String, config: ChildConfig, limits: Limits) -> Result<Child, String> {
        let state = match config.rule {
            None => State::Unresolved,
            Some(ChildRule::Native) => State::Native { seen: false },
            Some(ChildRule::Merge(_)) => State::Merge {
                family: None,
                merging: config
                    .configured_plan()
                    .map(|plan| merging(&label, plan, None, limits).map(Box::new))
                    .transpose()?,
            },
        };
        Ok(Child {
            label,
            config,
            state,
        })
    }

    pub fn merging(&self) -> Option<&Merging> {
        match &self.state {
            State::Merge { merging, .. } => merging.as_deref(),
            _ => None,
        }
    }

    pub fn merger_mut(&mut self) -> Option<&mut Merger> {
        match &mut self.state {
            State::Merge {
                merging: Some(m), ..
            } => Some(&mut m.merger),
            _ => None,
        }
    }

    pub fn is_native(&self) -> bool {
        matches!(self.state, State::Native { .. })
    }

    fn family(&self) -> Option<&str> {
        match &self.state {
            State::Unresolved | State::Native { seen: false } => None,
            State::Native { seen: true } => Some(NATIVE_FAMILY),
            State::Merge { family, .. } => family.as_deref(),
        }
    }

    /// The configured rule setting, as the log names it.
    fn setting(&self) -> String {
        match self.config.rule {
            Some(rule) => format!("'{}'", rule.name()),
            None => "None".into(),
        }
    }

    /// Takes a rank's native container (its class already checked).
    pub fn take_native(&mut self) -> Result<(), Why> {
        match &mut self.state {
            State::Unresolved => self.state = State::Native { seen: true },
            State::Native { seen } => *seen = true,
            State::Merge {
                family: Some(known),
                ..
            } => {
                return Err((
                    Kind::Family,
                    format!(
                        "a {NATIVE_FAMILY} container, but this child returned {known} \
                         containers before"
                    ),
                ))
            }
            State::Merge { family: None, .. } => {
                return Err((
                    Kind::Family,
                    format!(
                        "a {NATIVE_FAMILY} container, but the scheduler's {MERGE_KEY} setting \
                         is {}: {SAME_CONFIG}",
                        self.setting()
                    ),
                ))
            }
        }
        Ok(())
    }

    /// Takes a rank's batch of `family` (whose implied rule is `implied`)
    /// with the factors it `reported`: true when it made the merger. A
    /// refused part changes nothing.
    pub fn take_batch(
        &mut self,
        family: &str,
        implied: ChildRule,
        reported: Option<&[i64]>,
        limits: Limits,
    ) -> Result<bool, Why> {
        if let Some(known) = self.family().filter(|&known| known != family) {
            return Err((
                Kind::Family,
                format!("a {family} container, but this child returned {known} containers before"),
            ));
        }
        match &mut self.state {
            State::Native { .. } => Err((
                Kind::Family,
                format!(
                    "a {family} batch, but the scheduler's {MERGE_KEY} setting is {}: \
                     {SAME_CONFIG}",
                    self.setting()
                ),
            )),
            State::Merge {
                merging: Some(m),
                family: known,
            } => {
                if let (Source::Container, Some(reported)) = (m.plan.source, reported) {
                    let ours = m.plan.factors.as_deref().unwrap_or_default();
                    if !reported
                        .iter()
                        .copied()
                        .eq(ours.iter().map(|&f| i64::from(f)))
                    {
                        return Err((
                            Kind::Factors,
                            format!(
                                "replication factors {}, others {}; set {FACTORS_KEY} to choose",
                                py_factors(reported),
                                factors_repr(m.plan.factors.as_deref())
                            ),
                        ));
                    }
                }
                known.get_or_insert_with(|| family.to_owned());
                Ok(false)
            }
            State::Unresolved | State::Merge { merging: None, .. } => {
                let plan = self.config.plan(implied, reported).map_err(|fault| {
                    let detail = match fault {
                        PlanFault::Native => {
                            return (
                                Kind::Family,
                                format!(
                                "a {family} batch, but the scheduler infers {MERGE_KEY}='native' \
                                 for a {family} container: {SAME_CONFIG}"
                            ),
                            )
                        }
                        PlanFault::NoFactors => format!(
                            "{MERGE_KEY}='quorum' needs replication factors, one per KV cache \
                             group: set {FACTORS_KEY} in this child's kv_connector_extra_config \
                             (its containers carry none)"
                        ),
                        PlanFault::Factors(f) => format!(
                            "replication factors {} are not positive ints",
                            py_factors(&f)
                        ),
                    };
                    (Kind::Factors, detail)
                })?;
                let made = merging(&self.label, plan, Some(family), limits)
                    .map_err(|e| (Kind::Factors, e))?;
                self.state = State::Merge {
                    family: Some(family.to_owned()),
                    merging: Some(Box::new(made)),
                };
                Ok(true)
            }
        }
    }

    /// How this child merges, as its start-up log line says it.
    pub fn describe(&self) -> Option<String> {
        let m = self.merging()?;
        let config = m.merger.config();
        Some(format!(
            "rule '{}', replication factors {} (from {}), world size {}, max_pending_steps {}",
            m.plan.rule.name(),
            factors_repr(m.plan.factors.as_deref()),
            self.source_text(m.plan.source),
            config.carriers.world_size,
            config.max_pending_steps
        ))
    }

    fn source_text(&self, source: Source) -> String {
        match source {
            Source::Nowhere => "none".into(),
            Source::Config => FACTORS_KEY.into(),
            Source::Container => format!("the {} container", self.family().unwrap_or("?")),
        }
    }

    /// Why its merger refused a batch, as the log says it.
    pub fn explain(&self, e: &crate::Error) -> String {
        match (e, self.merging()) {
            (crate::Error::GroupOutOfRange { .. }, Some(m)) => {
                let rule = match self.config.rule {
                    Some(rule) => format!("{MERGE_KEY}='{}'", rule.name()),
                    None => format!(
                        "{MERGE_KEY} (inferred '{}' from a {} container)",
                        m.plan.rule.name(),
                        self.family().unwrap_or("?")
                    ),
                };
                format!(
                    "{rule} with replication factors {} (from {}) does not cover its KV cache \
                     group: {e}",
                    factors_repr(m.plan.factors.as_deref()),
                    self.source_text(m.plan.source)
                )
            }
            _ => e.to_string(),
        }
    }
}

/// The family a native child's containers count as in the log.
const NATIVE_FAMILY: &str = "native";

const SAME_CONFIG: &str = "workers and scheduler must share the same kv_transfer_config";

fn factors_repr(factors: Option<&[u32]>) -> String {
    factors.map_or_else(
        || "None".into(),
        |f| py_factors(&f.iter().map(|&x| i64::from(x)).collect::<Vec<_>>()),
    )
}

/// The merger `plan` makes for the child `label` (`family`: the container
/// it came from), or why it cannot be made.
fn merging(
    label: &str,
    plan: Plan,
    family: Option<&str>,
    limits: Limits,
) -> Result<Merging, String> {
    let mut cfg = MergerConfig::new(limits.world_size, plan.rule);
    cfg.max_pending_steps = limits.max_pending_steps;
    cfg.carriers.replication_factors = plan.factors.clone();
    let merger = Merger::new(cfg).map_err(|e| {
        let from = match (plan.source, family) {
            (Source::Nowhere, _) => "nowhere".to_owned(),
            (Source::Config, _) => FACTORS_KEY.to_owned(),
            (Source::Container, family) => format!("the {} container", family.unwrap_or("?")),
        };
        format!(
            "{label}: rule '{}' with replication factors {} (from {from}): {e}",
            plan.rule.name(),
            factors_repr(plan.factors.as_deref()),
        )
    })?;
    Ok(Merging {
        plan,
        merger: merger
            .with_guard(limits.guard)
            .with_deferred_carrier_check(true),
    })
}
