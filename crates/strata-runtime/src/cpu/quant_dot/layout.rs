//! Weight layouts the dot kernels read: the file's GGML rows, or eight rows interleaved per block.
//! Owns packing a file's rows into a kernel's layout and unpacking rows back to the file's bytes.

use std::ops::Range;

use strata_formats::GgmlType;

use super::weight_row_bytes;

/// Rows in a group of [`WeightLayout::RowGroups8`].
pub const GROUP_ROWS: usize = 8;

/// How a kernel expects the bytes of a weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    /// The file's rows, one after another (every type).
    File,
    /// Rows in groups of [`GROUP_ROWS`], the last group padded with zero rows. A group holds
    /// its rows' blocks side by side, each part of a block in file order: its f16 fields as
    /// eight consecutive values (`d` of rows 0..8, then `m` for Q4_1, `dmin` for Q4_K/Q5_K), packed
    /// scale bytes (Q4_K, Q6_K) byte by byte (byte `s` of rows 0..8, then byte `s + 1`), and the
    /// quants four bytes at a time, row after row (bytes `4j..4j + 4` of rows 0..8, then
    /// `4j + 4..4j + 8` of rows 0..8, ...), so that one 32-byte load holds the same four quant
    /// bytes of every row and a product lands in the lane of its row. The same bytes as the
    /// file's plus the padding rows. Read by the AVX2 and AVX-512 VNNI kernels of Q4_0, Q4_1,
    /// Q8_0, Q4_K, Q5_K and Q6_K.
    RowGroups8,
}

/// How a block of a type [`WeightLayout::RowGroups8`] holds is regrouped: its bytes as
/// segments in file order, each `(length, unit)`: the eight rows' segments side by side, `unit`
/// bytes of row 0, then of row 1, ... (2 for f16 scales, 1 for packed scale bytes, 4 for quants).
#[derive(Debug, Clone, Copy)]
struct GroupFields(&'static [(usize, usize)]);

impl GroupFields {
    /// The offset in a group's block (eight rows' blocks) of byte `k` of row `i`'s block.
    fn offset(self, i: usize, k: usize) -> usize {
        let mut start = 0;
        for &(len, unit) in self.0 {
            if k < start + len {
                let at = k - start;
                return GROUP_ROWS * (start + unit * (at / unit)) + unit * i + at % unit;
            }
            start += len;
        }
        unreachable!("byte {k} is past the block's segments")
    }

    /// Bytes of one row's block.
    fn block_bytes(self) -> usize {
        self.0.iter().map(|&(len, _)| len).sum()
    }
}

/// The segments of a block of a type [`WeightLayout::RowGroups8`] can hold.
fn group_fields(ty: GgmlType) -> Option<GroupFields> {
    Some(GroupFields(match ty {
        GgmlType::Q4_0 => &[(2, 2), (16, 4)],
        GgmlType::Q4_1 => &[(4, 2), (16, 4)],
        GgmlType::Q8_0 => &[(2, 2), (32, 4)],
        // d and dmin, twelve bytes of packed 6-bit scales and mins, 128 bytes of nibbles.
        GgmlType::Q4K => &[(4, 2), (12, 1), (128, 4)],
        // The same with 32 bytes of fifth bits before the nibbles.
        GgmlType::Q5K => &[(4, 2), (12, 1), (32, 4), (128, 4)],
        // 128 bytes of low nibbles and 64 of high bit pairs, sixteen i8 scales, d.
        GgmlType::Q6K => &[(192, 4), (16, 1), (2, 2)],
        _ => return None,
    }))
}

impl WeightLayout {
    /// Whether matrices of `ty` can be stored in this layout.
    pub fn holds(self, ty: GgmlType) -> bool {
        match self {
            WeightLayout::File => true,
            WeightLayout::RowGroups8 => group_fields(ty).is_some(),
        }
    }

    /// Rows a call may start at: a range of rows handed to a kernel starts at a multiple of this.
    pub fn row_align(self) -> usize {
        match self {
            WeightLayout::File => 1,
            WeightLayout::RowGroups8 => GROUP_ROWS,
        }
    }

    /// Rows the layout stores for a matrix of `rows` (with the padding).
    pub fn stored_rows(self, rows: usize) -> usize {
        rows.next_multiple_of(self.row_align())
    }

    /// Bytes a `rows x cols` matrix of `ty` takes in this layout.
    pub fn matrix_bytes(self, ty: GgmlType, rows: usize, cols: usize) -> usize {
        weight_row_bytes(ty, cols) * self.stored_rows(rows)
    }

    /// The bytes holding rows `rows` of a matrix of `cols` columns of `ty` (with the rest of
    /// the last group). `rows.start` must be a multiple of [`WeightLayout::row_align`].
    ///
    /// # Panics
    /// If `rows.start` is not aligned.
    pub fn row_bytes_range(self, ty: GgmlType, cols: usize, rows: Range<usize>) -> Range<usize> {
        let align = self.row_align();
        assert!(
            rows.start.is_multiple_of(align),
            "weight rows {rows:?} do not start on a group of {align}"
        );
        let rb = weight_row_bytes(ty, cols);
        rows.start * rb..self.stored_rows(rows.end.max(rows.start)) * rb
    }

    /// Writes the `rows x cols` matrix of `ty` whose file bytes are `file` into `out`
    /// ([`WeightLayout::matrix_bytes`] long) in this layout.
    ///
    /// # Panics
    /// If the layout cannot hold `ty` or a slice has the wrong length.
    pub fn pack(self, ty: GgmlType, rows: usize, cols: usize, file: &[u8], out: &mut [u8]) {
        let rb = weight_row_bytes(ty, cols);
        assert_eq!(file.len(), rb * rows, "pack: file bytes of {rows} x {cols} {ty}");
        assert_eq!(out.len(), self.matrix_bytes(ty, rows, cols), "pack: output size");
        let Some(fields) = self.group_fields(ty) else {
            out.copy_from_slice(file);
            return;
        };
        let bb = ty.block_bytes();
        debug_assert_eq!(fields.block_bytes(), bb);
        let gb = GROUP_ROWS * bb;
        let nb = cols / ty.block_len();
        for (g, dst) in out.chunks_exact_mut(nb * gb).enumerate() {
            for i in 0..GROUP_ROWS {
                let r = g * GROUP_ROWS + i;
                for (b, blk) in dst.chunks_exact_mut(gb).enumerate() {
                    for k in 0..bb {
                        blk[fields.offset(i, k)] = if r < rows { file[r * rb + b * bb + k] } else { 0 };
                    }
                }
            }
        }
    }

    /// Writes the file bytes of rows `rows` of a `cols`-column matrix of `ty` stored in this
    /// layout as `packed` (the whole matrix) into `out` (`rows.len()` file rows).
    ///
    /// # Panics
    /// If the layout cannot hold `ty` or a slice is too short.
    pub fn unpack_rows(self, ty: GgmlType, cols: usize, packed: &[u8], rows: Range<usize>, out: &mut [u8]) {
        let rb = weight_row_bytes(ty, cols);
        assert_eq!(out.len(), rb * rows.len(), "unpack_rows: output size");
        let Some(fields) = self.group_fields(ty) else {
            out.copy_from_slice(&packed[rows.start * rb..rows.end * rb]);
            return;
        };
        let bb = ty.block_bytes();
        let gb = GROUP_ROWS * bb;
        let nb = cols / ty.block_len();
        for (r, dst) in rows.zip(out.chunks_exact_mut(rb)) {
            let (g, i) = (r / GROUP_ROWS, r % GROUP_ROWS);
            let group = &packed[g * nb * gb..(g + 1) * nb * gb];
            for (blk, d) in group.chunks_exact(gb).zip(dst.chunks_exact_mut(bb)) {
                for (k, byte) in d.iter_mut().enumerate() {
                    *byte = blk[fields.offset(i, k)];
                }
            }
        }
    }

    /// Where a block's bytes go when this layout regroups `ty`, `None` when its bytes are the
    /// file's.
    ///
    /// # Panics
    /// If the layout cannot hold `ty`.
    fn group_fields(self, ty: GgmlType) -> Option<GroupFields> {
        match self {
            WeightLayout::File => None,
            WeightLayout::RowGroups8 => {
                Some(group_fields(ty).unwrap_or_else(|| panic!("{ty} weights have no row-group layout")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips_with_padding() {
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ] {
            let (rows, cols) = (13, 3 * ty.block_len());
            let rb = weight_row_bytes(ty, cols);
            let file: Vec<u8> = (0..rows * rb).map(|i| (i * 31 % 251) as u8).collect();
            let l = WeightLayout::RowGroups8;
            let mut packed = vec![0xaa; l.matrix_bytes(ty, rows, cols)];
            assert_eq!(packed.len(), 16 * rb);
            l.pack(ty, rows, cols, &file, &mut packed);
            let mut back = vec![0; rows * rb];
            l.unpack_rows(ty, cols, &packed, 0..rows, &mut back);
            assert_eq!(back, file, "{ty}");
            let mut some = vec![0; 3 * rb];
            l.unpack_rows(ty, cols, &packed, 7..10, &mut some);
            assert_eq!(some, file[7 * rb..10 * rb], "{ty}");
            // Padding rows are zero blocks: scale 0, so they add nothing.
            let mut pad = vec![0xff; rb];
            l.unpack_rows(ty, cols, &packed, 15..16, &mut pad);
            assert!(pad.iter().all(|&b| b == 0), "{ty}");
            assert_eq!(l.row_bytes_range(ty, cols, 8..13), 8 * rb..16 * rb);
        }
    }

    #[test]
    fn the_file_layout_is_the_file() {
        let ty = GgmlType::Q5_0;
        let file: Vec<u8> = (0..3 * 8 * 22).map(|i| i as u8).collect();
        let mut out = vec![0; file.len()];
        WeightLayout::File.pack(ty, 3, 256, &file, &mut out);
        assert_eq!(out, file);
        assert!(!WeightLayout::RowGroups8.holds(ty) && WeightLayout::File.holds(ty));
    }
}
