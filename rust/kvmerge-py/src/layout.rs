//! CPython's lists and small ints read in place, as msgspec reads them: the
//! token ids of an event are most of what a worker writes, and reading each
//! through the stable ABI (`PyList_GetItem`, `PyLong_AsLongLongAndOverflow`:
//! two calls per id) took twice msgspec's time per id (issue 14).
//!
//! The stable ABI promises neither layout, so this is used only where it is
//! known (CPython 3.11 to 3.14, the GIL build that loads abi3 modules) and
//! after reading known objects back at start-up agrees with the API
//! (`Layout::detect`); anywhere else every read takes the API's path.
//!
//! `KVMERGE_ASSUME_LAYOUT` (`sized` or `tagged`) names the layout to assume
//! instead of the version's, checked all the same; any other value takes the
//! API's path. The tests assume the other interpreters' layout, to see one
//! that disagrees fall back (tests/core/test_layout.py).

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList};

/// Where a list's items and an int's value are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// 3.11: `ob_size` is the signed number of 30-bit digits.
    Sized,
    /// 3.12 to 3.14: `lv_tag` holds the number of digits above its 3 low
    /// bits, the sign in the 2 lowest (0 positive, 1 zero, 2 negative).
    Tagged,
}

/// Both layouts: the header's third word (`ob_size` / `lv_tag`), then the
/// first digit; a list's item array after its size.
const WORD_AT: usize = 16;
const DIGIT_AT: usize = 24;
const ITEMS_AT: usize = 24;

const ASSUME: &str = "KVMERGE_ASSUME_LAYOUT";

/// How this interpreter's lists and ints are read: in place as `"sized"`
/// (3.11) or `"tagged"` (3.12 to 3.14), or None (through the API), so that
/// tests can tell the fast path is the one they exercise.
#[pyfunction]
pub fn _layout(py: Python<'_>) -> Option<&'static str> {
    Layout::detect(py).map(|layout| match layout {
        Layout::Sized => "sized",
        Layout::Tagged => "tagged",
    })
}

impl Layout {
    /// This interpreter's layout (or the one `KVMERGE_ASSUME_LAYOUT` names),
    /// if it is one of the known ones and reads known objects as the API does.
    pub fn detect(py: Python<'_>) -> Option<Layout> {
        let layout = match std::env::var_os(ASSUME) {
            Some(name) if name == "sized" => Layout::Sized,
            Some(name) if name == "tagged" => Layout::Tagged,
            Some(_) => return None,
            None => {
                let version = py.version_info();
                match (version.major, version.minor) {
                    (3, 11) => Layout::Sized,
                    (3, 12..=14) => Layout::Tagged,
                    _ => return None,
                }
            }
        };
        layout.agrees(py).then_some(layout)
    }

    fn agrees(self, py: Python<'_>) -> bool {
        let compact: [i64; 7] = [0, 1, 7, -7, (1 << 30) - 1, -((1 << 30) - 1), 128_255];
        let wide: [i64; 4] = [1 << 30, -(1 << 30), 1 << 62, i64::MIN];
        let ints_agree = compact.iter().all(|&v| {
            let o = PyInt::new(py, v);
            // SAFETY: a live int.
            unsafe { self.int(o.as_ptr()) == Some(v) }
        }) && wide.iter().all(|&v| {
            let o = PyInt::new(py, v);
            // SAFETY: a live int.
            unsafe { self.int(o.as_ptr()).is_none() }
        });
        let Ok(list) = PyList::new(py, compact) else {
            return false;
        };
        let lists_agree = (0..compact.len()).all(|i| {
            // SAFETY: a live list, `i` within it.
            unsafe {
                std::ptr::eq(
                    items(list.as_ptr()).add(i).read(),
                    ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t),
                )
            }
        });
        ints_agree && lists_agree
    }

    /// The value of an exact `int` of at most one digit (|v| < 2^30), None
    /// for a wider one.
    ///
    /// # Safety
    /// `v` must be a live object of exactly type `int`.
    #[inline]
    pub unsafe fn int(self, v: *mut ffi::PyObject) -> Option<i64> {
        let base = v.cast::<u8>();
        let word = base.add(WORD_AT).cast::<isize>().read();
        let digit = base.add(DIGIT_AT).cast::<u32>().read() as i64;
        match self {
            Layout::Sized => match word {
                0 => Some(0),
                1 => Some(digit),
                -1 => Some(-digit),
                _ => None,
            },
            Layout::Tagged => {
                let tag = word as usize;
                if tag >> 3 > 1 {
                    return None;
                }
                match tag & 3 {
                    0 => Some(digit),
                    1 => Some(0),
                    2 => Some(-digit),
                    _ => None,
                }
            }
        }
    }
}

/// A list's item array (`ob_item`), in either layout.
///
/// # Safety
/// `list` must be a live object of exactly type `list`.
#[inline]
pub unsafe fn items(list: *mut ffi::PyObject) -> *const *mut ffi::PyObject {
    list.cast::<u8>()
        .add(ITEMS_AT)
        .cast::<*const *mut ffi::PyObject>()
        .read()
}
