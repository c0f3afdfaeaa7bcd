//! `OutputMerger`, `ChildConfig`: the scheduler's step
//! (`kvmerge_core::step`) as Python calls it. Here only adaptation: the
//! outputs Python received seen as the core's `Outputs` (native containers
//! checked against vLLM's class), the merge run with the GIL released when
//! it is large, and each child's events handed back as Python values.

use std::collections::HashMap;
use std::ops::Range;

use kvmerge_core::step::{
    self, ChildConfig, ChildRule, Damage, Header, Kind, Outcome, Settings, StepConfig,
};
use kvmerge_core::{Batch, EventKind};
use pyo3::prelude::*;
use pyo3::types::{PyList, PySequence, PyString, PyTuple, PyType};

use crate::batch::PyEventBatch;
use crate::convert::type_name;
use crate::errors::config;
use crate::gil::{is_small, without_gil_unless};
use crate::merger::{raw_and_decoded, PyMergerStats};
use crate::output::PyWorkerOutput;
use crate::settings::PyWorkerSettings;

/// One refusal (`kvmerge_core::step::Refusal`), as Python reads it.
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

/// What one step gave one child.
#[pyclass(module = "kvmerge._kvmerge", frozen, get_all, name = "ChildStep")]
pub struct PyChildStep {
    events: Option<Py<PyAny>>,
    removed: Option<Py<PyAny>>,
    natives: Option<Py<PyList>>,
    lost: Option<String>,
    started: bool,
}

/// What one step gave, per child in config order, and its refusals.
#[pyclass(module = "kvmerge._kvmerge", frozen, get_all, name = "StepResult")]
pub struct PyStepResult {
    step: u64,
    ranks: Vec<i64>,
    children: Py<PyList>,
    refusals: Py<PyList>,
    gaps: Vec<(i64, i64, i64)>,
    expired: u64,
}

/// The outputs Python handed to a step, as the core reads them.
struct Received<'a, 'py> {
    py: Python<'py>,
    items: &'a [Bound<'py, PyAny>],
    native_type: &'a Bound<'py, PyType>,
}

impl Received<'_, '_> {
    fn output(&self, i: usize) -> Result<&PyWorkerOutput, Damage> {
        let item = &self.items[i];
        item.cast_exact::<PyWorkerOutput>()
            .map(|o| o.get())
            .map_err(|_| Damage {
                rank: None,
                why: format!("not a WorkerOutput but {}", type_name(item)),
            })
    }

    fn read(&self, i: usize) -> &crate::output::Read {
        self.output(i)
            .ok()
            .and_then(|o| o.read().ok())
            .expect("the core reads only the outputs whose header it has")
    }
}

impl<'py> step::Outputs for Received<'_, 'py> {
    type Native = Bound<'py, PyAny>;

    fn len(&self) -> usize {
        self.items.len()
    }

    fn header(&self, i: usize) -> Result<&Header, Damage> {
        match self.output(i)?.read() {
            Ok(read) => Ok(&read.header),
            Err(damage) => Err(Damage {
                rank: damage.rank,
                why: format!("the worker output is damaged: {}", damage.why),
            }),
        }
    }

    fn bytes(&self, i: usize, range: &Range<usize>) -> &[u8] {
        self.read(i).bytes(range)
    }

    fn batch(&self, i: usize, range: &Range<usize>) -> Result<Batch, String> {
        self.read(i).batch(self.py, range)
    }

    fn native(&self, i: usize, child: usize) -> Result<Self::Native, String> {
        let found = self.output(i).ok().and_then(|o| o.native(self.py, child));
        match found {
            Some(c) if c.is_instance(self.native_type).unwrap_or(false) => Ok(c),
            Some(c) => Err(type_name(&c)),
            None => Err("NoneType".to_owned()),
        }
    }

    // The child combines the step's containers into the first one
    // (`kvmerge.vllm.native`), as vLLM's aggregator does: each must be of a
    // class the first is an instance of.
    fn joins(&self, first: &Self::Native, later: &Self::Native) -> Result<(), String> {
        if first.is_instance(&later.get_type()).unwrap_or(false) {
            return Ok(());
        }
        Err(format!(
            "a {} container, where other ranks sent {} containers",
            type_name(later),
            type_name(first)
        ))
    }
}

#[pyclass(module = "kvmerge._kvmerge", name = "OutputMerger")]
pub struct PyOutputMerger {
    core: step::OutputMerger,
    native_type: Py<PyType>,
    /// Whether merged events leave as objects (else as `msgspec.Raw` views).
    objects: bool,
    /// Per child: whether its scheduler has a removal hook.
    hooks: Vec<bool>,
}

/// `"{class}: {message}"` of a Python exception.
fn py_error_text(py: Python<'_>, e: &PyErr) -> String {
    let class = e
        .get_type(py)
        .name()
        .map_or_else(|_| "Exception".to_owned(), |n| n.to_string());
    format!("{class}: {}", e.value(py))
}

impl PyOutputMerger {
    /// A child's step as Python values: its events decoded or viewed, or
    /// why they are lost (a forged removal for the hook does not decode).
    fn child_step(
        &self,
        py: Python<'_>,
        index: usize,
        step: step::ChildStep,
        natives: Vec<(i64, Bound<'_, PyAny>)>,
    ) -> PyResult<PyChildStep> {
        let mut out = PyChildStep {
            events: None,
            removed: None,
            natives: None,
            lost: None,
            started: step.started,
        };
        match step.outcome {
            Outcome::Idle => {}
            Outcome::Native => {
                out.natives = Some(PyList::new(py, natives)?.unbind());
            }
            Outcome::Merged(published) => {
                let kind = (self.hooks[index] && !self.objects).then_some(EventKind::BlockRemoved);
                let decoded = if self.objects {
                    let batch = Bound::new(py, PyEventBatch::new(published.into_batch()))?;
                    PyEventBatch::decode(&batch).map(|events| (events, None))
                } else {
                    raw_and_decoded(py, &published, kind)
                        .map(|(raws, removed)| (raws.into_any(), kind.map(|_| removed)))
                };
                match decoded {
                    Ok((events, removed)) => {
                        out.events = Some(events.unbind());
                        out.removed = removed.map(Bound::unbind);
                    }
                    Err(e) => out.lost = Some(py_error_text(py, &e)),
                }
            }
        }
        Ok(out)
    }
}

// The Python-facing docs are in _kvmerge.pyi; comments here say why.
#[pymethods]
impl PyOutputMerger {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (settings, max_pending_steps, families, native_type, hooks, *, objects = false, guard = true))]
    fn new(
        py: Python<'_>,
        settings: &Bound<'_, PyWorkerSettings>,
        max_pending_steps: u64,
        families: HashMap<String, String>,
        native_type: Bound<'_, PyType>,
        hooks: Vec<bool>,
        objects: bool,
        guard: bool,
    ) -> PyResult<Self> {
        let settings: Settings = settings.get().0.clone();
        if hooks.len() != settings.children.len() {
            return Err(config(
                py,
                format!(
                    "{} removal hooks for {} children",
                    hooks.len(),
                    settings.children.len()
                ),
            ));
        }
        let families = families
            .into_iter()
            .map(|(family, rule)| match ChildRule::parse(&rule) {
                Some(rule) => Ok((family, rule)),
                None => Err(config(
                    py,
                    format!("the {family} family implies '{rule}', which is no rule"),
                )),
            })
            .collect::<PyResult<_>>()?;
        let core = step::OutputMerger::new(StepConfig {
            settings,
            max_pending_steps,
            families,
            guard,
        })
        .map_err(|e| config(py, e.0))?;
        Ok(PyOutputMerger {
            core,
            native_type: native_type.unbind(),
            objects,
            hooks,
        })
    }

    fn step(&mut self, py: Python<'_>, outputs: Vec<Bound<'_, PyAny>>) -> PyResult<PyStepResult> {
        let native_type = self.native_type.bind(py).clone();
        let received = Received {
            py,
            items: &outputs,
            native_type: &native_type,
        };
        let (took, natives) = self.core.take(&received).map_err(|e| config(py, e.0))?;
        let (bytes, reports) = took.load();
        let core = &mut self.core;
        let step = without_gil_unless(py, is_small(bytes, reports), || core.merge(took));
        let result = PyStepResult {
            step: step.step,
            ranks: step.ranks,
            gaps: step.gaps,
            expired: step.expired,
            refusals: PyList::new(
                py,
                step.refusals
                    .into_iter()
                    .map(|r| PyRefusal {
                        kind: r.kind.name(),
                        rank: r.rank,
                        child: r.child,
                        detail: r.detail,
                    })
                    .collect::<Vec<_>>(),
            )?
            .unbind(),
            children: PyList::empty(py).unbind(),
        };
        let children = step
            .children
            .into_iter()
            .zip(natives)
            .enumerate()
            .map(|(index, (child, natives))| self.child_step(py, index, child, natives))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyStepResult {
            children: PyList::new(py, children)?.unbind(),
            ..result
        })
    }

    #[getter]
    fn steps(&self) -> u64 {
        self.core.steps()
    }

    fn stats(&self) -> Vec<Option<PyMergerStats>> {
        self.core
            .stats()
            .into_iter()
            .map(|s| s.map(PyMergerStats::from))
            .collect()
    }

    fn describe(&self, index: usize) -> Option<String> {
        self.core.children().get(index)?.describe()
    }

    fn reset(&mut self) {
        self.core.reset();
    }
}

/// A child's configured rule and factors (`kvmerge_core::step::ChildConfig`).
#[pyclass(module = "kvmerge._kvmerge", frozen, name = "ChildConfig")]
pub struct PyChildConfig(ChildConfig);

/// `written` as the operator wrote it, for a fault's message.
fn repr(written: &Bound<'_, PyAny>) -> String {
    written
        .repr()
        .map_or_else(|_| type_name(written), |r| r.to_string())
}

/// A factors setting as ints, or None when it is no list of ints (a str,
/// a bool, anything else).
fn factor_list(obj: &Bound<'_, PyAny>) -> Option<Vec<i64>> {
    if obj.is_instance_of::<PyString>() || obj.cast::<PySequence>().is_err() {
        return None;
    }
    let items: Vec<Bound<'_, PyAny>> = obj.extract().ok()?;
    items
        .iter()
        .map(|f| {
            (!f.is_instance_of::<pyo3::types::PyBool>())
                .then(|| f.cast::<pyo3::types::PyInt>().ok()?.extract::<i64>().ok())
                .flatten()
        })
        .collect()
}

/// A plan as `encode` takes it: the rule, and the factors "quorum" uses.
type PlanArgs<'py> = (&'static str, Option<Bound<'py, PyTuple>>);

fn child_rule(py: Python<'_>, name: &str) -> PyResult<ChildRule> {
    ChildRule::parse(name).ok_or_else(|| config(py, format!("'{name}' is no rule")))
}

// The Python-facing docs are in _kvmerge.pyi.
#[pymethods]
impl PyChildConfig {
    #[new]
    #[pyo3(signature = (rule = None, factors = None))]
    fn new(
        py: Python<'_>,
        rule: Option<Bound<'_, PyAny>>,
        factors: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let rule = rule.filter(|r| !r.is_none());
        let factors = factors.filter(|f| !f.is_none());
        let rule_name = match &rule {
            None => None,
            Some(r) => match r.cast::<PyString>() {
                Ok(s) => Some(s.to_str()?.to_owned()),
                Err(_) => return Err(config(py, step::ConfigFault::Rule(repr(r)).to_string())),
            },
        };
        let factor_values = match &factors {
            None => None,
            Some(f) => match factor_list(f) {
                Some(values) => Some(values),
                None => return Err(config(py, step::ConfigFault::Factors(repr(f)).to_string())),
            },
        };
        let checked = ChildConfig::new(rule_name.as_deref(), factor_values.as_deref());
        match checked {
            Ok(c) => Ok(PyChildConfig(c)),
            // The operator's own spelling of what they wrote.
            Err(step::ConfigFault::Rule(_)) => Err(config(
                py,
                step::ConfigFault::Rule(repr(rule.as_ref().expect("a rule"))).to_string(),
            )),
            Err(step::ConfigFault::Factors(_)) => Err(config(
                py,
                step::ConfigFault::Factors(repr(factors.as_ref().expect("factors"))).to_string(),
            )),
            Err(fault) => Err(config(py, fault.to_string())),
        }
    }

    #[getter]
    fn rule(&self) -> Option<&'static str> {
        self.0.rule().map(ChildRule::name)
    }

    #[getter]
    fn factors<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        self.0.factors().map(|f| PyTuple::new(py, f)).transpose()
    }

    fn rule_for(&self, py: Python<'_>, implied: &str) -> PyResult<&'static str> {
        Ok(self.0.rule_for(child_rule(py, implied)?).name())
    }

    #[pyo3(signature = (implied, reported = None))]
    fn plan<'py>(
        &self,
        py: Python<'py>,
        implied: &str,
        reported: Option<Vec<i64>>,
    ) -> PyResult<Option<PlanArgs<'py>>> {
        let Ok(plan) = self.0.plan(child_rule(py, implied)?, reported.as_deref()) else {
            return Ok(None);
        };
        let factors = plan.factors.map(|f| PyTuple::new(py, f)).transpose()?;
        Ok(Some((plan.rule.name(), factors)))
    }

    fn __repr__(&self) -> String {
        let factors = self.0.factors().map_or_else(
            || "None".to_owned(),
            |f| format!("{:?}", f.iter().collect::<Vec<_>>()),
        );
        format!(
            "ChildConfig(rule={}, factors={factors})",
            self.0
                .rule()
                .map_or_else(|| "None".to_owned(), |r| format!("'{}'", r.name()))
        )
    }
}

/// Every refusal kind, `(name, meaning)`, in declaration order.
#[pyfunction]
pub fn _refusal_kinds() -> Vec<(&'static str, &'static str)> {
    Kind::ALL.iter().map(|k| (k.name(), k.doc())).collect()
}
