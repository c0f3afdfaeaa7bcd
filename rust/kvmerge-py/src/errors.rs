//! One exception hierarchy, and the single place where core errors become
//! Python exceptions. Each class is listed once, in `exceptions!` below; its
//! docstring is written once, in `_kvmerge.pyi`, which `build.rs` reads.

use kvmerge_core::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;

// `pyi_doc!(Class)`: the stub's docstring of `Class`.
include!(concat!(env!("OUT_DIR"), "/pyi_docs.rs"));

create_exception!(kvmerge, KVMergeError, PyException, pyi_doc!(KVMergeError));

/// The exceptions besides `KVMergeError`, each `Class(KVMergeError, std)`
/// (catchable as either) and raised for the core errors its patterns match;
/// one without patterns is raised by the binding alone. Also makes `add_to`,
/// which adds the whole hierarchy to the module, and the core errors'
/// mapping, whose match fails to compile if a core error is left out.
macro_rules! exceptions {
    ($($fn_name:ident: $name:ident($std:ty) <= [$($core:pat)?];)*) => {
        $(
            pub fn $fn_name(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
                static CELL: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> =
                    pyo3::sync::PyOnceLock::new();
                let ty = CELL.get_or_try_init(py, || -> PyResult<_> {
                    let bases = (py.get_type::<KVMergeError>(), py.get_type::<$std>());
                    let ns = pyo3::types::PyDict::new(py);
                    ns.set_item("__doc__", pyi_doc!($name))?;
                    ns.set_item("__module__", "kvmerge")?;
                    let ty = py
                        .get_type::<pyo3::types::PyType>()
                        .call1((stringify!($name), bases, ns))?
                        .cast_into::<pyo3::types::PyType>()?;
                    Ok(ty.unbind())
                })?;
                Ok(ty.bind(py).clone().into_any())
            }
        )*

        /// Adds `KVMergeError` and every class above to the module.
        pub fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
            let py = m.py();
            m.add("KVMergeError", py.get_type::<KVMergeError>())?;
            $(m.add(stringify!($name), $fn_name(py)?)?;)*
            Ok(())
        }

        /// The class a core error is raised as.
        fn class_of<'py>(py: Python<'py>, e: &Error) -> PyResult<Bound<'py, PyAny>> {
            match e {
                $($($core => $fn_name(py),)?)*
            }
        }
    };
}

exceptions! {
    corrupt_batch_error: CorruptBatchError(PyValueError) <= [Error::CorruptBatch(_)];
    invalid_event_error: InvalidEventError(PyTypeError)
        <= [Error::InvalidEvent { .. } | Error::InvalidPayload(_)];
    config_error: ConfigError(PyValueError) <= [Error::Config(_)];
    rank_error: RankError(PyValueError)
        <= [Error::RankOutOfRange { .. } | Error::DuplicateRank { .. }];
    group_error: GroupError(PyValueError) <= [Error::GroupOutOfRange { .. }];
    incomplete_batch_error: IncompleteBatchError(PyValueError) <= [];
    capacity_error: CapacityError(PyValueError) <= [Error::TooLarge(_)];
}

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
        Python::attach(|py| raise(class_of(py, &e.0), e.0.to_string()))
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
