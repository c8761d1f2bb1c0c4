//! TMA tensor maps: the 128-byte descriptors Hopper's bulk tensor copies read, encoded on the
//! host by the driver and passed to a kernel by value (a `__grid_constant__` parameter).

use cudarc::driver::sys;

use super::{driver, CudaError};

/// One encoded tensor map (`CUtensorMap`), laid out as a kernel parameter takes it.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TmaMap(pub [u64; 16]);

impl TmaMap {
    /// No map: what a kernel compiled without TMA gets, and never reads.
    pub const NONE: TmaMap = TmaMap([0; 16]);
}

/// A bf16 row-major `[rows, cols]` matrix's tensor-map geometry for boxes of `box_cols` x
/// `box_rows`, innermost dimension first as `cuTensorMapEncodeTiled` takes it: the dimensions,
/// the row stride in bytes, and the box.
pub fn bf16_matrix_geometry(rows: usize, cols: usize, box_cols: u32, box_rows: u32) -> ([u64; 2], [u64; 1], [u32; 2]) {
    ([cols as u64, rows as u64], [(cols * 2) as u64], [box_cols, box_rows])
}

/// The map of a bf16 row-major `[rows, cols]` matrix at device address `ptr`, for boxes of
/// `box_cols` (128 bytes at most) x `box_rows` copied with the 128-byte swizzle (wgmma's and
/// quant.cu's `qtile_at`), zeros where a box reaches past the matrix.
pub fn encode_bf16_matrix_map(
    ptr: u64,
    rows: usize,
    cols: usize,
    box_cols: u32,
    box_rows: u32,
) -> Result<TmaMap, CudaError> {
    let (dims, strides, boxes) = bf16_matrix_geometry(rows, cols, box_cols, box_rows);
    encode_2d(
        ptr,
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        (dims, strides, boxes),
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )
}

/// The map of `rows` rows of `row_bytes` bytes each (a multiple of 16) at `ptr`, as bytes, for
/// boxes of `box_bytes` (16, 32 or 64) x `box_rows` laid out with the swizzle of their width
/// (none, 32 B, 64 B: quant.cu's `plane_at`), zeros where a box reaches past the rows.
pub fn encode_byte_rows_map(
    ptr: u64,
    rows: usize,
    row_bytes: usize,
    box_bytes: u32,
    box_rows: u32,
) -> Result<TmaMap, CudaError> {
    let swizzle = match box_bytes {
        64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        32 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
        _ => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    };
    let geometry = (
        [row_bytes as u64, rows as u64],
        [row_bytes as u64],
        [box_bytes, box_rows],
    );
    encode_2d(
        ptr,
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        geometry,
        swizzle,
    )
}

/// `cuTensorMapEncodeTiled` of a 2D tensor: (dimensions, row stride in bytes, box), innermost
/// first, no OOB fill value but zeros.
fn encode_2d(
    ptr: u64,
    dtype: sys::CUtensorMapDataType,
    (dims, strides, boxes): ([u64; 2], [u64; 1], [u32; 2]),
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<TmaMap, CudaError> {
    let unit = [1u32, 1];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: the arrays hold the rank's (2) entries; the driver only writes `map`.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            dtype,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            unit.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .map_err(driver("cuTensorMapEncodeTiled"))?;
    }
    Ok(TmaMap(map.opaque))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_is_the_128_aligned_bytes_a_grid_constant_takes() {
        assert_eq!(std::mem::size_of::<TmaMap>(), 128);
        assert_eq!(std::mem::align_of::<TmaMap>(), 64);
        assert_eq!(std::mem::size_of::<sys::CUtensorMap>(), 128);
    }

    #[test]
    fn the_geometry_lists_columns_first_and_strides_in_bytes() {
        // x of 200 tokens x 3584 columns, boxes of 64 columns x 256 tokens.
        let (dims, strides, boxes) = bf16_matrix_geometry(200, 3584, 64, 256);
        assert_eq!(dims, [3584, 200]);
        assert_eq!(strides, [7168]);
        assert_eq!(boxes, [64, 256]);
    }
}
