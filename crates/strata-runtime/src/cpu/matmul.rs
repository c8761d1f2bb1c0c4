//! Matrix products of a (possibly quantized) weight matrix with a batch of activation rows.
//! Activations are quantized to the weight's dot format, then weight rows are split over threads.

use strata_formats::quant::dequantize;
use strata_formats::GgmlType;

use super::disjoint::DisjointMut;
use super::gemm::{gemm_packed, pack_panels, packed_len, PANEL};
use super::quant_dot::{act_residual, act_row_bytes, kernel_for, quantize_act_row, ActFormat, DotKernel, WeightLayout};
use super::threadpool::ThreadPool;

/// A weight matrix of a GGML type: `rows` output features, each a row of `cols` inputs, its
/// bytes in the layout its kernel reads ([`crate::cpu::quant_dot::cpu_layout`]).
#[derive(Clone, Copy)]
pub struct WeightMatrix<'a> {
    pub kernel: DotKernel,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl std::fmt::Debug for WeightMatrix<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "WeightMatrix({} x {} {})",
            self.rows,
            self.cols,
            self.kernel.weight_type()
        )
    }
}

/// Why a weight cannot be used for matrix products.
#[derive(Debug, thiserror::Error)]
pub enum MatmulError {
    #[error("weight type {0} has no CPU matmul kernel")]
    UnsupportedType(GgmlType),
    #[error("weight of {rows} x {cols} {ty} needs {need} bytes in the {layout:?} layout, got {got}")]
    WrongSize {
        rows: usize,
        cols: usize,
        ty: GgmlType,
        layout: WeightLayout,
        need: u64,
        got: usize,
    },
}

impl<'a> WeightMatrix<'a> {
    /// Checks the size and picks the dot kernel for a `rows x cols` matrix of type `ty` whose
    /// bytes `data` are in that kernel's layout.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, MatmulError> {
        let kernel = kernel_for(ty).ok_or(MatmulError::UnsupportedType(ty))?;
        Self::check_size(ty, rows, cols, kernel.layout(), data.len())?;
        Ok(WeightMatrix {
            kernel,
            rows,
            cols,
            data,
        })
    }

    /// Checks that the CPU has a kernel for `ty` and that `len` bytes hold a `rows x cols`
    /// matrix of it in `layout` (e.g. a file's tensor, in [`WeightLayout::File`]).
    pub fn check_size(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        layout: WeightLayout,
        len: usize,
    ) -> Result<(), MatmulError> {
        kernel_for(ty).ok_or(MatmulError::UnsupportedType(ty))?;
        let rows_stored = layout.stored_rows(rows) as u64;
        let need = ty.bytes_for(rows_stored * (cols as u64)).unwrap_or(u64::MAX);
        if need != len as u64 || !cols.is_multiple_of(ty.block_len()) {
            return Err(MatmulError::WrongSize {
                rows,
                cols,
                ty,
                layout,
                need,
                got: len,
            });
        }
        Ok(())
    }

    /// The bytes holding rows `rows` (starting on the layout's row alignment).
    fn rows_data(&self, rows: std::ops::Range<usize>) -> &'a [u8] {
        let ty = self.kernel.weight_type();
        &self.data[self.kernel.layout().row_bytes_range(ty, self.cols, rows)]
    }

    /// Rows of this matrix in the row list threads split: padded to the layout's alignment.
    fn split_rows(&self) -> usize {
        self.kernel.layout().stored_rows(self.rows)
    }
}

/// Reusable buffers of [`matmul`].
#[derive(Default, Debug)]
pub struct MatmulScratch {
    acts: Vec<Vec<u8>>,
    rows_major: Vec<f32>,
}

/// How the rows of a product are computed: the first `dense` rows by dequantizing weight tiles
/// into an f32 GEMM (compute-bound prompt rows), the remaining `quantized` rows by integer dot
/// products against the packed weights (bandwidth-bound decode rows). A row's result depends on
/// its path and its values only, never on the other rows: that is what makes batching invisible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowPaths {
    pub dense: usize,
    pub quantized: usize,
    /// How the quantized rows' activations are carried.
    pub precision: ActPrecision,
}

/// Precision of the activations on the quantized-dot path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActPrecision {
    /// Each row quantized twice, value and rounding residual: ~14 bits, logits within 0.02 %
    /// of an f64 reference, greedy text unchanged. Twice the integer work of `Standard`: for
    /// checking outputs against a float reference, or where greedy text must not drift.
    High,
    /// One 8-bit quantization per row, as llama.cpp does: ~1 % logit drift that can change
    /// greedy text, about twice the throughput where batched decode is compute-bound. The
    /// default of the engine and the CLI; with row-grouped weights the model sends its prompt
    /// rows through these kernels too (`Transformer`'s `matmul_paths`).
    #[default]
    Standard,
}

impl ActPrecision {
    /// Parses `high` or `standard`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "high" => Ok(ActPrecision::High),
            "standard" => Ok(ActPrecision::Standard),
            other => Err(format!(
                "unknown activation precision {other:?}; use high (~14-bit, exact greedy text) or standard (8-bit, faster)"
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ActPrecision::High => "high",
            ActPrecision::Standard => "standard",
        }
    }
}

impl RowPaths {
    /// All `m` rows through the GEMM path.
    pub fn dense(m: usize) -> Self {
        RowPaths {
            dense: m,
            quantized: 0,
            precision: ActPrecision::High,
        }
    }

    /// All `m` rows through the quantized-dot path, at high precision.
    pub fn quantized(m: usize) -> Self {
        RowPaths {
            dense: 0,
            quantized: m,
            precision: ActPrecision::High,
        }
    }

    /// The same rows with the quantized ones at `precision`.
    pub fn with_precision(self, precision: ActPrecision) -> Self {
        RowPaths { precision, ..self }
    }

    /// Rows in all.
    pub fn total(&self) -> usize {
        self.dense + self.quantized
    }
}

/// Weight rows dequantized at a time on the GEMM path: two packed panels, small enough that
/// the tiles of Q/K/V (or gate/up) split evenly over the threads.
const GEMM_TILE_ROWS: usize = 2 * PANEL;

/// The prompt path of [`matmul_many`]: f32 GEMM of the `m` rows of `x` with weight tiles
/// dequantized and packed on the fly; threads take tiles of all matrices from one list.
fn matmul_dequant_gemm(pool: &ThreadPool, ws: &[WeightMatrix], x: &[f32], m: usize, outs: &mut [&mut [f32]]) {
    // Tiles of all matrices, end to end.
    let mut first_tile = Vec::with_capacity(ws.len() + 1);
    let mut total = 0;
    for w in ws {
        first_tile.push(total);
        total += w.rows.div_ceil(GEMM_TILE_ROWS);
    }
    first_tile.push(total);
    let outps: Vec<DisjointMut<f32>> = outs.iter_mut().map(|o| DisjointMut::new(&mut o[..])).collect();
    pool.parallel_for(total, 1, &|tiles| {
        TILE_BUFFERS
            .with_borrow_mut(|(wt, panels)| dequant_gemm_tiles(ws, x, m, &first_tile, &outps, tiles, wt, panels))
    });
}

thread_local! {
    /// Each thread's dequantized tile and its packed panels, kept across calls: buffers this
    /// large come from fresh pages (faults and zeroing) when allocated per call.
    static TILE_BUFFERS: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    /// Each thread's file-layout copy of a tile's rows when the matrix is stored regrouped.
    static TILE_FILE_ROWS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows `rows` of `w` dequantized to f32 into `out` (`rows.len() * w.cols` values).
fn dequantize_rows(w: &WeightMatrix, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let ty = w.kernel.weight_type();
    let layout = w.kernel.layout();
    let checked = "weight size and type were checked by WeightMatrix::new";
    if layout == WeightLayout::File {
        dequantize(ty, w.rows_data(rows), out).expect(checked);
        return;
    }
    TILE_FILE_ROWS.with_borrow_mut(|file| {
        file.resize(rows.len() * super::quant_dot::weight_row_bytes(ty, w.cols), 0);
        layout.unpack_rows(ty, w.cols, w.data, rows, file);
        dequantize(ty, file, out).expect(checked);
    });
}

/// The tiles `tiles` of [`matmul_dequant_gemm`]'s list, on one thread.
#[allow(clippy::too_many_arguments)]
fn dequant_gemm_tiles(
    ws: &[WeightMatrix],
    x: &[f32],
    m: usize,
    first_tile: &[usize],
    outps: &[DisjointMut<f32>],
    tiles: std::ops::Range<usize>,
    wt: &mut Vec<f32>,
    panels: &mut Vec<f32>,
) {
    let k = ws[0].cols;
    wt.resize(GEMM_TILE_ROWS * k, 0.0);
    panels.resize(packed_len(GEMM_TILE_ROWS, k), 0.0);
    for tile in tiles {
        let wi = first_tile.partition_point(|&f| f <= tile) - 1;
        let w = &ws[wi];
        let n = w.rows;
        let r0 = (tile - first_tile[wi]) * GEMM_TILE_ROWS;
        let rows = GEMM_TILE_ROWS.min(n - r0);
        let wt = &mut wt[..rows * k];
        dequantize_rows(w, r0..r0 + rows, wt);
        pack_panels(wt, rows, k, k, 1, panels);
        // SAFETY: this thread alone writes columns r0..r0+rows of the m output rows (stride n).
        unsafe { gemm_packed(m, rows, k, x, k, panels, outps[wi].as_mut_ptr().add(r0), n) };
    }
}

/// `out[j * w.rows + r] = dot(w row r, x row j)` for the `m` rows of `x` (`m * w.cols` values).
///
/// For quantized weights each activation row is quantized twice: once as is and once the
/// rounding residual, and the two integer dot products are added. That carries ~14 bits of
/// every activation (8-bit activations alone drift ~1 % in the logits and change greedy
/// text). The weight blocks are unpacked once for both rows.
///
/// Each output value is computed the same way whatever `m` is and however rows are split
/// over threads, so results do not depend on what else is in the batch.
pub fn matmul(
    pool: &ThreadPool,
    w: &WeightMatrix,
    x: &[f32],
    rows: RowPaths,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    matmul_many(pool, &[*w], x, rows, &mut [out], scratch);
}

/// [`matmul`] of several matrices with the same input (Q, K and V; gate and up) in one
/// parallel region: the input is quantized once per activation format, and threads split
/// the rows of all matrices together (fewer synchronisations per layer in decode).
pub fn matmul_many(
    pool: &ThreadPool,
    ws: &[WeightMatrix],
    x: &[f32],
    rows: RowPaths,
    outs: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
) {
    let m = rows.total();
    assert_eq!(
        ws.len(),
        outs.len(),
        "matmul_many: {} matrices but {} outputs",
        ws.len(),
        outs.len()
    );
    let Some(k) = ws.first().map(|w| w.cols) else { return };
    assert_eq!(x.len(), m * k, "matmul: x has {} values, expected {m} x {k}", x.len());
    for (w, out) in ws.iter().zip(outs.iter()) {
        assert_eq!(w.cols, k, "matmul_many: matrices take inputs of different widths");
        assert_eq!(
            out.len(),
            m * w.rows,
            "matmul: out has {} values, expected {m} x {}",
            out.len(),
            w.rows
        );
    }
    if m == 0 {
        return;
    }
    let d = rows.dense;
    if d > 0 {
        let mut dense_outs: Vec<&mut [f32]> = outs.iter_mut().zip(ws).map(|(o, w)| &mut o[..d * w.rows]).collect();
        matmul_dequant_gemm(pool, ws, &x[..d * k], d, &mut dense_outs);
    }
    if rows.quantized == 0 {
        return;
    }
    let mut quantized_outs: Vec<&mut [f32]> = outs.iter_mut().zip(ws).map(|(o, w)| &mut o[d * w.rows..]).collect();
    let residual = rows.precision == ActPrecision::High;
    matmul_quantized(
        pool,
        ws,
        &x[d * k..],
        rows.quantized,
        residual,
        &mut quantized_outs,
        scratch,
    );
}

/// The decode path of [`matmul_many`]: `m` rows through the integer dot kernels, with the
/// rounding residual of each row as a second row when `residual`.
fn matmul_quantized(
    pool: &ThreadPool,
    ws: &[WeightMatrix],
    x: &[f32],
    m: usize,
    residual: bool,
    outs: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
) {
    let k = ws[0].cols;
    // Quantize the input (value + residual rows) once per activation format in use.
    let mut formats: Vec<ActFormat> = Vec::new();
    for w in ws {
        if !formats.contains(&w.kernel.act_format()) {
            formats.push(w.kernel.act_format());
        }
    }
    scratch.acts.resize(formats.len(), Vec::new());
    for (fmt, buf) in formats.iter().zip(scratch.acts.iter_mut()) {
        quantize_rows(pool, *fmt, x, m, k, residual, buf);
    }
    // Rows of all matrices (each padded to its layout's row groups), end to end; threads take
    // contiguous ranges of this virtual list, starting on a multiple of `align`.
    let mut first_row = Vec::with_capacity(ws.len() + 1);
    let mut total = 0;
    for w in ws {
        first_row.push(total);
        total += w.split_rows();
    }
    first_row.push(total);
    let max_ma = 2 * m;
    scratch.rows_major.resize(total * max_ma, 0.0);
    let tmp = DisjointMut::new(&mut scratch.rows_major[..]);
    let outps: Vec<DisjointMut<f32>> = outs.iter_mut().map(|o| DisjointMut::new(&mut o[..])).collect();
    let acts_by_fmt: Vec<(ActFormat, &[u8])> = formats
        .iter()
        .copied()
        .zip(scratch.acts.iter().map(|b| &b[..]))
        .collect();
    let body = |virt: std::ops::Range<usize>| {
        for (wi, w) in ws.iter().enumerate() {
            let (lo, hi) = (first_row[wi].max(virt.start), first_row[wi + 1].min(virt.end));
            if lo >= hi {
                continue;
            }
            // The padding rows of a row group are computed by no one.
            let rows = lo - first_row[wi]..(hi - first_row[wi]).min(w.rows);
            if rows.is_empty() {
                continue;
            }
            let fmt = w.kernel.act_format();
            let acts = acts_by_fmt
                .iter()
                .find(|(f, _)| *f == fmt)
                .map(|(_, a)| *a)
                .unwrap_or_default();
            let split = residual && fmt != ActFormat::F32;
            let ma = if split { 2 * m } else { m };
            let wdata = w.rows_data(rows.clone());
            let n = w.rows;
            // SAFETY: virtual row ranges are disjoint between threads, so are their tmp ranges.
            let t = unsafe { tmp.range_mut(lo * max_ma..lo * max_ma + rows.len() * ma) };
            let outp = &outps[wi];
            // Several rows without the residual split: by activation row where the kernel
            // writes so, one contiguous run of each output row to copy.
            if m > 1 && !split && w.kernel.dot_matrix_columns(k, wdata, rows.len(), acts, m, t) {
                for (j, run) in t.chunks_exact(rows.len()).enumerate() {
                    let at = j * n + rows.start;
                    // SAFETY: columns `rows` of every output row belong to this thread only.
                    unsafe { outp.range_mut(at..at + rows.len()) }.copy_from_slice(run);
                }
                continue;
            }
            w.kernel.dot_matrix(k, wdata, rows.len(), acts, ma, t);
            if m == 1 {
                // SAFETY: rows of this output in `rows` belong to this thread only.
                let o = unsafe { outp.range_mut(rows.clone()) };
                for (ri, o) in o.iter_mut().enumerate() {
                    *o = if split { t[2 * ri] + t[2 * ri + 1] } else { t[ri] };
                }
                continue;
            }
            // Transpose to the output's row-major layout 16 weight rows at a time: the tile
            // of `t` stays in L1 and each output row gets one contiguous run.
            for c in (0..rows.len()).step_by(16) {
                let ce = (c + 16).min(rows.len());
                let tc = &t[c * ma..ce * ma];
                for j in 0..m {
                    let at = j * n + rows.start;
                    // SAFETY: columns `rows` of every output row belong to this thread only.
                    let o = unsafe { outp.range_mut(at + c..at + ce) };
                    for (o, tr) in o.iter_mut().zip(tc.chunks_exact(ma)) {
                        *o = if split { tr[2 * j] + tr[2 * j + 1] } else { tr[j] };
                    }
                }
            }
        }
    };
    // One equal part per thread (rows cost the same), on a multiple of every layout's row
    // alignment.
    pool.split_even(total, 16, &body);
}

/// Quantizes the `m` rows of `x` into `buf`: for integer formats with `residual` each row as
/// two rows, the quantized value and the quantized rounding residual.
fn quantize_rows(pool: &ThreadPool, fmt: ActFormat, x: &[f32], m: usize, k: usize, residual: bool, buf: &mut Vec<u8>) {
    let split = residual && fmt != ActFormat::F32;
    let parts = if split { 2 } else { 1 };
    let arb = act_row_bytes(fmt, k);
    buf.resize(arb * m * parts, 0);
    let acts = DisjointMut::new(&mut buf[..]);
    let quantize_row = |j: usize, residual: &mut [f32]| {
        let xj = &x[j * k..(j + 1) * k];
        // SAFETY: rows j*parts.. belong to this thread's range only.
        let dst = unsafe { acts.range_mut(j * parts * arb..(j + 1) * parts * arb) };
        let (hi, lo) = dst.split_at_mut(arb);
        quantize_act_row(fmt, xj, hi);
        if split {
            act_residual(fmt, xj, hi, residual);
            quantize_act_row(fmt, residual, lo);
        }
    };
    if m == 1 {
        let mut residual = [0.0f32; 8192];
        if k <= residual.len() {
            quantize_row(0, &mut residual[..k]);
            return;
        }
    }
    pool.parallel_for(m, 16, &|range| {
        let mut residual = vec![0.0f32; k];
        for j in range {
            quantize_row(j, &mut residual);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_matmul_matches_naive_and_is_batch_invariant() {
        let (n, k, m) = (37, 64, 5);
        let wf: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
        let bytes: Vec<u8> = wf.iter().flat_map(|v| v.to_le_bytes()).collect();
        let w = WeightMatrix::new(GgmlType::F32, n, k, &bytes).unwrap();
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 31) % 17) as f32 / 17.0 - 0.5).collect();
        let pool = ThreadPool::new(2);
        let mut out = vec![0.0; m * n];
        let mut scratch = MatmulScratch::default();
        matmul(&pool, &w, &x, RowPaths::quantized(m), &mut out, &mut scratch);
        for j in 0..m {
            for r in 0..n {
                let want: f32 = (0..k).map(|c| wf[r * k + c] * x[j * k + c]).sum();
                assert!((out[j * n + r] - want).abs() < 1e-4);
            }
            let mut single = vec![0.0; n];
            matmul(
                &pool,
                &w,
                &x[j * k..(j + 1) * k],
                RowPaths::quantized(1),
                &mut single,
                &mut scratch,
            );
            assert_eq!(
                &out[j * n..(j + 1) * n],
                &single[..],
                "row {j} differs alone vs in a batch"
            );
        }
    }

    #[test]
    fn dense_rows_do_not_depend_on_the_batch_or_on_quantized_rows_beside_them() {
        let (n, k, m) = (130, 256, 40);
        let bytes = cpu_bytes(&q4_1_matrix(n, k), n, k);
        let w = WeightMatrix::new(GgmlType::Q4_1, n, k, &bytes).unwrap();
        let x: Vec<f32> = (0..m * k).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
        let pool = ThreadPool::new(2);
        let mut scratch = MatmulScratch::default();
        // 25 dense rows and 15 quantized rows in one call.
        let mut mixed = vec![0.0; m * n];
        let paths = RowPaths {
            dense: 25,
            quantized: 15,
            precision: ActPrecision::High,
        };
        matmul(&pool, &w, &x, paths, &mut mixed, &mut scratch);
        for j in 0..m {
            let one = if j < 25 {
                RowPaths::dense(1)
            } else {
                RowPaths::quantized(1)
            };
            let mut single = vec![0.0; n];
            matmul(&pool, &w, &x[j * k..(j + 1) * k], one, &mut single, &mut scratch);
            assert_eq!(
                &mixed[j * n..(j + 1) * n],
                &single[..],
                "row {j} differs alone vs in a batch"
            );
        }
    }

    /// Several matrices in one call, split over threads at any row: each output equals the
    /// matrix's product alone (a thread's range before or after a matrix must skip it).
    #[test]
    fn matmul_many_splits_rows_over_matrices_of_any_size() {
        let k = 64;
        let shapes = [40usize, 13, 24, 7];
        let files: Vec<Vec<u8>> = shapes.iter().map(|&n| q4_1_matrix(n, k)).collect();
        let packed: Vec<Vec<u8>> = files.iter().zip(shapes).map(|(f, n)| cpu_bytes(f, n, k)).collect();
        let ws: Vec<WeightMatrix> = packed
            .iter()
            .zip(shapes)
            .map(|(b, n)| WeightMatrix::new(GgmlType::Q4_1, n, k, b).unwrap())
            .collect();
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for m in [1, 3] {
                let x: Vec<f32> = (0..m * k).map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0).collect();
                let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&n| vec![f32::NAN; m * n]).collect();
                let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                let paths = RowPaths::quantized(m).with_precision(ActPrecision::Standard);
                matmul_many(&pool, &ws, &x, paths, &mut refs, &mut MatmulScratch::default());
                for (w, got) in ws.iter().zip(&outs) {
                    let mut alone = vec![0.0; m * w.rows];
                    matmul(&pool, w, &x, paths, &mut alone, &mut MatmulScratch::default());
                    assert_eq!(got, &alone, "{w:?}, {threads} threads, m = {m}");
                }
            }
        }
    }

    /// `rows x cols` Q4_1 file bytes in the layout the CPU's kernel reads.
    fn cpu_bytes(file: &[u8], rows: usize, cols: usize) -> Vec<u8> {
        let layout = super::super::quant_dot::cpu_layout(GgmlType::Q4_1);
        let mut out = vec![0u8; layout.matrix_bytes(GgmlType::Q4_1, rows, cols)];
        layout.pack(GgmlType::Q4_1, rows, cols, file, &mut out);
        out
    }

    /// Random Q4_1 rows with sane f16 scale and min.
    fn q4_1_matrix(rows: usize, cols: usize) -> Vec<u8> {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut bytes = Vec::new();
        for _ in 0..rows * cols / 32 {
            let d = half::f16::from_f32(0.01 + (next() % 100) as f32 / 5000.0);
            let m = half::f16::from_f32(-((next() % 100) as f32) / 1000.0);
            bytes.extend_from_slice(&d.to_le_bytes());
            bytes.extend_from_slice(&m.to_le_bytes());
            bytes.extend((0..16).map(|_| next() as u8));
        }
        bytes
    }

    #[test]
    fn quantized_matmul_carries_about_14_bits_of_the_activations() {
        let (n, k, m) = (48, 256, 3);
        let file = q4_1_matrix(n, k);
        let bytes = cpu_bytes(&file, n, k);
        let w = WeightMatrix::new(GgmlType::Q4_1, n, k, &bytes).unwrap();
        let mut wf = vec![0.0f32; n * k];
        dequantize(GgmlType::Q4_1, &file, &mut wf).unwrap();
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0).powi(3))
            .collect();
        let pool = ThreadPool::new(2);
        let mut out = vec![0.0; m * n];
        matmul(
            &pool,
            &w,
            &x,
            RowPaths::quantized(m),
            &mut out,
            &mut MatmulScratch::default(),
        );
        let mut worst = 0.0f64;
        for j in 0..m {
            for r in 0..n {
                let exact: f64 = (0..k).map(|c| wf[r * k + c] as f64 * x[j * k + c] as f64).sum();
                let scale: f64 = (0..k).map(|c| (wf[r * k + c] as f64 * x[j * k + c] as f64).abs()).sum();
                worst = worst.max((out[j * n + r] as f64 - exact).abs() / scale);
            }
        }
        // 8-bit activations alone give 1.5e-3 here; value + residual must be far below.
        assert!(worst < 2e-4, "relative error {worst:e}");
        let mut standard = vec![0.0; m * n];
        let paths = RowPaths::quantized(m).with_precision(ActPrecision::Standard);
        matmul(&pool, &w, &x, paths, &mut standard, &mut MatmulScratch::default());
        let mut worst8 = 0.0f64;
        for j in 0..m {
            for r in 0..n {
                let exact: f64 = (0..k).map(|c| wf[r * k + c] as f64 * x[j * k + c] as f64).sum();
                let scale: f64 = (0..k).map(|c| (wf[r * k + c] as f64 * x[j * k + c] as f64).abs()).sum();
                worst8 = worst8.max((standard[j * n + r] as f64 - exact).abs() / scale);
            }
            let mut single = vec![0.0; n];
            let one = RowPaths::quantized(1).with_precision(ActPrecision::Standard);
            matmul(
                &pool,
                &w,
                &x[j * k..(j + 1) * k],
                one,
                &mut single,
                &mut MatmulScratch::default(),
            );
            assert_eq!(
                &standard[j * n..(j + 1) * n],
                &single[..],
                "standard row {j} alone vs batch"
            );
        }
        assert!(worst8 < 4e-3 && worst8 > worst, "8-bit relative error {worst8:e}");
        // And the batch does not change any row's result.
        for j in 0..m {
            let mut single = vec![0.0; n];
            matmul(
                &pool,
                &w,
                &x[j * k..(j + 1) * k],
                RowPaths::quantized(1),
                &mut single,
                &mut MatmulScratch::default(),
            );
            assert_eq!(&out[j * n..(j + 1) * n], &single[..]);
        }
    }
}
