//! A global allocator that counts the bytes each thread has live and their peak, so a test can
//! bound what one call allocates; an absurd request saves the input that made it before aborting.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Counts allocations per thread (tests running in parallel do not see each other's).
pub struct CountingAllocator;

/// A single request this large is a bug, not a big input: the driver's input is saved first.
const ABSURD_REQUEST: usize = 1 << 34;

thread_local! {
    static LIVE_BYTES: Cell<isize> = const { Cell::new(0) };
    static PEAK_BYTES: Cell<isize> = const { Cell::new(0) };
    /// The input being checked on this thread and the file to save it to, set by the driver.
    static CURRENT_INPUT: Cell<Option<(*const u8, usize, &'static str)>> = const { Cell::new(None) };
    static SAVING: Cell<bool> = const { Cell::new(false) };
}

fn record(delta: isize) {
    let _ = LIVE_BYTES.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK_BYTES.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

/// Before the process aborts on an absurd request, writes the input that made it where the
/// driver said, so the crash can be replayed and kept as a regression.
fn save_input_before_abort(size: usize) {
    let Ok(Some((ptr, len, path))) = CURRENT_INPUT.try_with(Cell::get) else {
        return;
    };
    if SAVING.try_with(|s| s.replace(true)).unwrap_or(true) {
        return;
    }
    // SAFETY: `CurrentInput` registered a live slice and clears it before the slice goes away.
    let input = unsafe { std::slice::from_raw_parts(ptr, len) };
    let _ = std::fs::write(path, input);
    eprintln!("strata-fuzz: an input asked for {size} bytes at once; it is saved at {path}");
}

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= ABSURD_REQUEST {
            save_input_before_abort(layout.size());
        }
        record(layout.size() as isize);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        record(-(layout.size() as isize));
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= ABSURD_REQUEST {
            save_input_before_abort(layout.size());
        }
        record(layout.size() as isize);
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= ABSURD_REQUEST {
            save_input_before_abort(new_size);
        }
        record(new_size as isize - layout.size() as isize);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Runs `f` and returns its result with the most bytes it had allocated at once on this thread
/// (meaningful only in a binary whose `#[global_allocator]` is a [`CountingAllocator`]).
pub fn peak_allocation<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE_BYTES.with(Cell::get);
    PEAK_BYTES.with(|p| p.set(base));
    let result = f();
    let peak = PEAK_BYTES.with(Cell::get);
    (result, (peak - base).max(0) as usize)
}

/// Registers the input being checked on this thread until the guard drops; an absurd
/// allocation meanwhile writes it to the registered path.
pub(crate) struct CurrentInput;

/// Keeps an input registered; dropping it clears the registration.
pub(crate) struct CurrentInputGuard<'a>(std::marker::PhantomData<&'a [u8]>);

impl CurrentInput {
    /// The guard borrows `input`, so the registration cannot outlive it.
    pub(crate) fn set<'a>(input: &'a [u8], path: &'static str) -> CurrentInputGuard<'a> {
        CURRENT_INPUT.with(|c| c.set(Some((input.as_ptr(), input.len(), path))));
        CurrentInputGuard(std::marker::PhantomData)
    }
}

impl Drop for CurrentInputGuard<'_> {
    fn drop(&mut self) {
        CURRENT_INPUT.with(|c| c.set(None));
    }
}
