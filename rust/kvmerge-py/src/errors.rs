//! One exception hierarchy, and the single place where core errors become
//! Python exceptions. The classes' docstrings are _kvmerge.pyi's, word for
//! word (exceptions made at run time need theirs here too).

use kvmerge_core::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    kvmerge,
    KVMergeError,
    PyException,
    "Base of every error kvmerge raises."
);

/// Declares `$name(KVMergeError, $std)`: catchable as either.
macro_rules! subclass {
    ($fn_name:ident, $name:literal, $std:ty, $doc:literal) => {
        pub fn $fn_name(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
            static CELL: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> =
                pyo3::sync::PyOnceLock::new();
            let ty = CELL.get_or_try_init(py, || -> PyResult<_> {
                let bases = (py.get_type::<KVMergeError>(), py.get_type::<$std>());
                let ns = pyo3::types::PyDict::new(py);
                ns.set_item("__doc__", $doc)?;
                ns.set_item("__module__", "kvmerge")?;
                let ty = py
                    .get_type::<pyo3::types::PyType>()
                    .call1(($name, bases, ns))?
                    .cast_into::<pyo3::types::PyType>()?;
                Ok(ty.unbind())
            })?;
            Ok(ty.bind(py).clone().into_any())
        }
    };
}

subclass!(
    corrupt_batch_error,
    "CorruptBatchError",
    PyValueError,
    "A batch buffer is truncated, corrupted or not a kvmerge batch."
);
subclass!(
    invalid_event_error,
    "InvalidEventError",
    PyTypeError,
    "`encode` got something that is not a vLLM KV cache event of a known shape."
);
subclass!(
    config_error,
    "ConfigError",
    PyValueError,
    "A `Merger` setting is invalid."
);
subclass!(
    rank_error,
    "RankError",
    PyValueError,
    "A rank outside the world, or a rank added twice in one step."
);
subclass!(
    incomplete_batch_error,
    "IncompleteBatchError",
    PyValueError,
    "A batch that does not carry all of its events' bytes (other ranks carry them): it can be merged, not read."
);
subclass!(
    group_error,
    "GroupError",
    PyValueError,
    "A `BlockStored.group_idx` without a replication factor (rule \"quorum\")."
);

subclass!(
    capacity_error,
    "CapacityError",
    PyValueError,
    "A batch the merger cannot take: with it, one step's merged output could exceed a batch's 4 GiB limit (`Merger.add`; drop the batch)."
);

/// A core error on its way to Python (polars' `PyPolarsErr` pattern).
pub struct PyKvError(pub Error);

impl From<Error> for PyKvError {
    fn from(e: Error) -> Self {
        PyKvError(e)
    }
}

/// Raises `class(message)`, or whatever went wrong building the class.
fn raise(class: PyResult<Bound<'_, PyAny>>, message: String) -> PyErr {
    match class.and_then(|c| c.call1((message,))) {
        Ok(instance) => PyErr::from_value(instance),
        Err(e) => e,
    }
}

impl From<PyKvError> for PyErr {
    fn from(e: PyKvError) -> PyErr {
        Python::attach(|py| {
            let message = e.0.to_string();
            let class = match e.0 {
                Error::CorruptBatch(_) => corrupt_batch_error(py),
                Error::InvalidEvent { .. } | Error::InvalidPayload(_) => invalid_event_error(py),
                Error::Config(_) => config_error(py),
                Error::RankOutOfRange { .. } | Error::DuplicateRank { .. } => rank_error(py),
                Error::GroupOutOfRange { .. } => group_error(py),
                Error::TooLarge(_) => capacity_error(py),
            };
            raise(class, message)
        })
    }
}

/// Raises `InvalidEventError(message)`.
pub fn invalid_event(py: Python<'_>, message: String) -> PyErr {
    raise(invalid_event_error(py), message)
}

/// Raises `CorruptBatchError(message)`.
pub fn corrupt_batch(py: Python<'_>, message: String) -> PyErr {
    raise(corrupt_batch_error(py), message)
}

pub fn incomplete_batch(py: Python<'_>, message: String) -> PyErr {
    raise(incomplete_batch_error(py), message)
}

pub fn config(py: Python<'_>, message: String) -> PyErr {
    raise(config_error(py), message)
}

pub fn rank_out_of_range(py: Python<'_>, message: String) -> PyErr {
    raise(rank_error(py), message)
}
