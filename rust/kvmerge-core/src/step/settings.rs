//! What a worker believes, sent with its first output and compared by the
//! scheduler (`step`): another kvmerge release on some hosts, KV events off
//! on one worker, another child list, rule or world size would otherwise
//! lose events without a word.

use super::repr::{py_bool, py_factors, py_str};

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

/// `repr(children)`, as Python writes the settings' list of children.
pub fn py_children(children: &[ChildSettings]) -> String {
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
}
