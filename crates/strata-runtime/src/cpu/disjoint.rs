//! Shared write access to one buffer from many threads, each writing its own disjoint range.
//! The parallel kernels use it to fill one output without locks or copies.

use std::marker::PhantomData;
use std::ops::Range;

/// A mutable slice that threads of one parallel region write at disjoint ranges.
#[derive(Clone, Copy)]
pub struct DisjointMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: access goes through `range_mut`, whose contract requires disjoint ranges per thread.
unsafe impl<T: Send> Send for DisjointMut<'_, T> {}
unsafe impl<T: Send> Sync for DisjointMut<'_, T> {}

impl<'a, T> DisjointMut<'a, T> {
    /// Wraps `slice` for the duration of a parallel region.
    pub fn new(slice: &'a mut [T]) -> Self {
        DisjointMut {
            ptr: slice.as_mut_ptr(),
            len: slice.len(),
            _borrow: PhantomData,
        }
    }

    /// Raw pointer to element 0, for strided writes (e.g. a GEMM writing a column block).
    /// Writers must keep to elements no other thread touches.
    pub fn as_mut_ptr(&self) -> *mut T {
        self.ptr
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sub-slice `range`.
    ///
    /// # Safety
    /// No two live results may overlap: each thread must use ranges no other thread uses
    /// during the same parallel region.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range_mut(&self, range: Range<usize>) -> &mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "DisjointMut: {range:?} outside 0..{}",
            self.len
        );
        // SAFETY: in bounds (checked above); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}
