//! Allocation sizes, measured with a counting global allocator (hence a
//! test binary of its own, with a single test: no other thread allocates
//! while it measures).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvmerge_core::{Batch, Error};

struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

/// fuzz `encode_payload` with `-malloc_limit_mb=16`, oom-e0710e8d: the
/// 5-byte payload `dd 6f f9 3f ff` announces 1.9 billion events, and encode
/// reserved records for up to 2^20 of them (40 MiB) before reading any.
#[test]
fn encode_allocates_in_proportion_to_its_input() {
    for payload in [
        &[0xdd, 0x6f, 0xf9, 0x3f, 0xff][..],
        &[0xdd, 0xff, 0xff, 0xff, 0xff],
        &[0xdc, 0xff, 0xff, 0x80],
    ] {
        LARGEST.store(0, Ordering::Relaxed);
        let result = Batch::encode(payload);
        let largest = LARGEST.load(Ordering::Relaxed);
        assert!(matches!(result, Err(Error::InvalidEvent { index: 0, .. })));
        assert!(largest < 4096, "{payload:02x?}: allocated {largest} bytes");
    }
}
