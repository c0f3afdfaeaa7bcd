//! What a worker believes, sent with its first output and compared by the
//! scheduler (`step`): another kvmerge release on some hosts, KV events off
//! on one worker, another child list, rule or world size would otherwise
//! lose events without a word.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// A child's configured rule and factors, by its label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildSettings {
    pub label: String,
    pub rule: Option<String>,
    pub factors: Option<Vec<i64>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub version: String,
    pub world_size: i64,
    pub rank: i64,
    pub kv_events: bool,
    pub children: Vec<ChildSettings>,
}

impl Settings {
    /// Each setting in which `worker`'s (from an output of `rank`) differs
    /// from these, the scheduler's: `"setting: worker ..., scheduler ..."`,
    /// values as Python writes them.
    pub fn differences(&self, worker: &Settings, rank: i64) -> Vec<String> {
        let mut found = Vec::new();
        if worker.rank != rank {
            found.push(format!(
                "rank: worker believes {}, its output says {rank}",
                worker.rank
            ));
        }
        let mut differ = |name: &str, theirs: String, ours: String| {
            if theirs != ours {
                found.push(format!("{name}: worker {theirs}, scheduler {ours}"));
            }
        };
        differ(
            "kvmerge_version",
            py_str(&worker.version),
            py_str(&self.version),
        );
        differ(
            "world_size",
            worker.world_size.to_string(),
            self.world_size.to_string(),
        );
        differ(
            "kv_events",
            py_bool(worker.kv_events),
            py_bool(self.kv_events),
        );
        if worker.children != self.children {
            found.push(format!(
                "connectors (label, kv_events_merge, kv_events_replication_factors): \
                 worker {}, scheduler {}",
                py_children(&worker.children),
                py_children(&self.children)
            ));
        }
        found
    }
}

fn py_bool(b: bool) -> String {
    if b { "True" } else { "False" }.to_owned()
}

/// `repr(text)`, for the texts settings hold.
fn py_str(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// `repr(tuple(factors))`.
pub fn py_factors(factors: &[i64]) -> String {
    match factors {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            factors
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn py_children(children: &[ChildSettings]) -> String {
    let items: Vec<String> = children
        .iter()
        .map(|c| {
            format!(
                "({}, {}, {})",
                py_str(&c.label),
                c.rule.as_deref().map_or("None".into(), py_str),
                c.factors.as_deref().map_or("None".into(), py_factors)
            )
        })
        .collect();
    format!("[{}]", items.join(", "))
}

/// A child's settings as Python passes them: `(label, rule, factors)`.
type ChildArg = (String, Option<String>, Option<Vec<i64>>);

#[pyclass(module = "kvmerge._kvmerge", frozen, eq, name = "WorkerSettings")]
#[derive(PartialEq)]
pub struct PyWorkerSettings(pub Settings);

// The Python-facing docs are in _kvmerge.pyi.
#[pymethods]
impl PyWorkerSettings {
    #[new]
    #[pyo3(signature = (kvmerge_version, world_size, rank, kv_events, children))]
    fn new(
        kvmerge_version: String,
        world_size: i64,
        rank: i64,
        kv_events: bool,
        children: Vec<ChildArg>,
    ) -> Self {
        PyWorkerSettings(Settings {
            version: kvmerge_version,
            world_size,
            rank,
            kv_events,
            children: children
                .into_iter()
                .map(|(label, rule, factors)| ChildSettings {
                    label,
                    rule,
                    factors,
                })
                .collect(),
        })
    }

    #[getter]
    fn kvmerge_version(&self) -> &str {
        &self.0.version
    }

    #[getter]
    fn world_size(&self) -> i64 {
        self.0.world_size
    }

    #[getter]
    fn rank(&self) -> i64 {
        self.0.rank
    }

    #[getter]
    fn kv_events(&self) -> bool {
        self.0.kv_events
    }

    #[getter]
    fn children<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let items = self
            .0
            .children
            .iter()
            .map(|c| {
                let factors = match &c.factors {
                    None => py.None().into_bound(py),
                    Some(f) => PyTuple::new(py, f)?.into_any(),
                };
                PyTuple::new(
                    py,
                    [
                        c.label.clone().into_pyobject(py)?.into_any(),
                        c.rule.clone().into_pyobject(py)?.into_any(),
                        factors,
                    ],
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, items)
    }

    fn differences(&self, worker: &PyWorkerSettings, rank: i64) -> Vec<String> {
        self.0.differences(&worker.0, rank)
    }

    fn __repr__(&self) -> String {
        let s = &self.0;
        format!(
            "WorkerSettings(kvmerge_version={}, world_size={}, rank={}, kv_events={}, children={})",
            py_str(&s.version),
            s.world_size,
            s.rank,
            py_bool(s.kv_events),
            py_children(&s.children)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(rank: i64) -> Settings {
        Settings {
            version: "0.1.0".into(),
            world_size: 2,
            rank,
            kv_events: true,
            children: vec![ChildSettings {
                label: "connectors[0] (A)".into(),
                rule: None,
                factors: Some(vec![2]),
            }],
        }
    }

    #[test]
    fn agreeing_settings_have_no_difference() {
        // The scheduler's own rank (-1) is not compared: the worker's is,
        // with its output's.
        assert_eq!(
            settings(-1).differences(&settings(1), 1),
            Vec::<String>::new()
        );
        assert_eq!(settings(-1).differences(&settings(1), 0).len(), 1);
    }

    #[test]
    fn each_difference_is_named_as_python_writes_it() {
        let ours = settings(1);
        let theirs = Settings {
            version: "0.0.1".into(),
            world_size: 4,
            kv_events: false,
            children: vec![],
            ..settings(0)
        };
        assert_eq!(
            ours.differences(&theirs, 1),
            [
                "rank: worker believes 0, its output says 1",
                "kvmerge_version: worker '0.0.1', scheduler '0.1.0'",
                "world_size: worker 4, scheduler 2",
                "kv_events: worker False, scheduler True",
                "connectors (label, kv_events_merge, kv_events_replication_factors): \
                 worker [], scheduler [('connectors[0] (A)', None, (2,))]",
            ]
        );
    }

    #[test]
    fn texts_are_quoted_as_repr_does() {
        assert_eq!(py_str("it's"), "\"it's\"");
        assert_eq!(py_str("a'\"b"), "'a\\'\"b'");
        assert_eq!(py_factors(&[1, 2]), "(1, 2)");
    }
}
