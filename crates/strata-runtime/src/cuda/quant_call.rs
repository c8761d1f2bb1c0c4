//! The calls of quant.cu over GGUF blocks kept quantized on the GPU (int8 activations and the
//! GEMVs over them, the tensor-core GEMM, dequantization to bf16, embedding lookups), and the
//! formats' device layout.

use std::ffi::c_void;

use strata_formats::GgmlType;

use super::gemm_call::{gemv_kernels, GEMV_KERNEL_TOKENS, GEMV_THREADS};
use super::kernels::FAMILIES;
use super::norm_call::ROW_THREADS;
use super::tma::{encode_bf16_matrix_map, encode_byte_rows_map, TmaMap};
use super::CudaError;
use crate::kernel_args;

/// A GGUF block format the GPU reads without dequantizing it first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

/// Every format, in quant.cu's (and [`FAMILIES`]') order.
pub const QUANT_FORMATS: [QuantFormat; 6] = [
    QuantFormat::Q4_0,
    QuantFormat::Q4_1,
    QuantFormat::Q8_0,
    QuantFormat::Q4K,
    QuantFormat::Q5K,
    QuantFormat::Q6K,
];

/// Rows a quantized GEMV block computes, a warp each (quant.cu: GEMV_WARPS).
const QGEMV_ROWS: u32 = GEMV_THREADS / 32;

/// Kernels quant.cu defines per format: GEMVs (plain, SiLU, residual) for each compiled token
/// count, then dequantization, the embedding lookup and the two GEMMs (registers, tiles).
const KERNELS_PER_FORMAT: usize = 3 * 4 + 4;

/// Which of a format's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Gemv,
    Silu,
    Residual,
    Dequant,
    Embedding,
    Gemm,
    GemmTile,
}

impl QuantFormat {
    /// The GPU format of a GGML type, if it has one.
    pub fn of(ty: GgmlType) -> Option<QuantFormat> {
        Some(match ty {
            GgmlType::Q4_0 => QuantFormat::Q4_0,
            GgmlType::Q4_1 => QuantFormat::Q4_1,
            GgmlType::Q8_0 => QuantFormat::Q8_0,
            GgmlType::Q4K => QuantFormat::Q4K,
            GgmlType::Q5K => QuantFormat::Q5K,
            GgmlType::Q6K => QuantFormat::Q6K,
            _ => return None,
        })
    }

    pub fn ggml_type(self) -> GgmlType {
        match self {
            QuantFormat::Q4_0 => GgmlType::Q4_0,
            QuantFormat::Q4_1 => GgmlType::Q4_1,
            QuantFormat::Q8_0 => GgmlType::Q8_0,
            QuantFormat::Q4K => GgmlType::Q4K,
            QuantFormat::Q5K => GgmlType::Q5K,
            QuantFormat::Q6K => GgmlType::Q6K,
        }
    }

    /// Values a block holds (a row's length must be a multiple).
    pub fn block_len(self) -> usize {
        self.ggml_type().block_len()
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        self.ggml_type().block_bytes()
    }

    /// The f16 fields quant.cu reads from a plane after the blocks' other bytes: (offset in the
    /// block, bytes); `None` keeps the file's blocks (already 16-byte aligned).
    pub fn plane_fields(self) -> Option<(usize, usize)> {
        match self {
            QuantFormat::Q4_0 | QuantFormat::Q8_0 => Some((0, 2)),
            QuantFormat::Q4_1 => Some((0, 4)),
            QuantFormat::Q6K => Some((208, 2)),
            QuantFormat::Q4K | QuantFormat::Q5K => None,
        }
    }

    /// Writes `rows` whole rows of file blocks (`blocks`, rows of `row_blocks` blocks, the
    /// rows `first..first + rows` of a segment of `segment_rows`) where quant.cu reads them in
    /// the segment's device bytes: `put(offset, bytes)` once or twice.
    pub fn place_rows(
        self,
        blocks: &[u8],
        row_blocks: usize,
        first: usize,
        segment_rows: usize,
        put: &mut dyn FnMut(usize, &[u8]),
    ) {
        let bb = self.block_bytes();
        match self.plane_fields() {
            None => put(first * row_blocks * bb, blocks),
            Some((at, len)) => {
                let body = bb - len;
                let n = blocks.len() / bb;
                let mut bodies = Vec::with_capacity(n * body);
                let mut fields = Vec::with_capacity(n * len);
                for b in blocks.chunks_exact(bb) {
                    bodies.extend_from_slice(&b[..at]);
                    bodies.extend_from_slice(&b[at + len..]);
                    fields.extend_from_slice(&b[at..at + len]);
                }
                put(first * row_blocks * body, &bodies);
                put(segment_rows * row_blocks * body + first * row_blocks * len, &fields);
            }
        }
    }

    /// quant.cu's name for the format (`q4_k`).
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q4_0 => "q4_0",
            QuantFormat::Q4_1 => "q4_1",
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::Q4K => "q4_k",
            QuantFormat::Q5K => "q5_k",
            QuantFormat::Q6K => "q6_k",
        }
    }

    /// Values a quant.cu thread decodes at a time (the columns of a dequantization thread).
    fn unit_len(self) -> usize {
        match self {
            QuantFormat::Q4_0 | QuantFormat::Q4_1 | QuantFormat::Q8_0 => 32,
            QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K => 64,
        }
    }

    /// The kernel of `kind` for this format (and `t` tokens for the GEMVs), by its place in
    /// [`FAMILIES`]' quant list.
    ///
    /// # Panics
    /// When a GEMV is asked for 0 or more than [`GEMV_KERNEL_TOKENS`] tokens.
    fn kernel(self, kind: Kind, t: i32) -> &'static str {
        let tokens = || {
            let g = gemv_kernels(t.max(0) as usize)
                .unwrap_or_else(|| panic!("no quantized GEMV is compiled for {t} tokens (1 to {GEMV_KERNEL_TOKENS})"));
            g.tokens.trailing_zeros() as usize
        };
        let offset = match kind {
            Kind::Gemv => tokens(),
            Kind::Silu => 4 + tokens(),
            Kind::Residual => 8 + tokens(),
            Kind::Dequant => 12,
            Kind::Embedding => 13,
            Kind::Gemm => 14,
            Kind::GemmTile => 15,
        };
        let format = QUANT_FORMATS.iter().position(|&f| f == self).unwrap_or_default();
        quant_kernels()[format * KERNELS_PER_FORMAT + offset]
    }

    /// The widths in bytes of the planes the wide tiles' stages hold a step's bytes in (quant.cu's
    /// `WIDE_WIDTH`), and the bytes of a block in a row of the segment's body (`WIDE_BLOCK_BYTES`).
    pub fn wide_planes(self) -> (&'static [u32], usize) {
        match self {
            QuantFormat::Q4K => (&[16, 32], 144),
            QuantFormat::Q6K => (&[64, 32, 16], 208),
            _ => (&[], self.block_bytes()),
        }
    }

    /// Whether quant.cu has wide tiles (`qgemm_wide*`) for this format.
    pub fn has_wide_tiles(self) -> bool {
        matches!(self, QuantFormat::Q4K | QuantFormat::Q6K)
    }

    /// quant.cu's GEMM on the wide tile `tile` for this format (`qgemm_wide{64,128,192,}_*`), where
    /// it has one.
    pub fn wide_kernel(self, tile: QuantGemmTile) -> Option<&'static str> {
        let at = wide_kernels_at(tile)?;
        match self {
            QuantFormat::Q4K => Some(quant_kernels()[at]),
            QuantFormat::Q6K => Some(quant_kernels()[at + 1]),
            _ => None,
        }
    }
}

/// Where `tile`'s wide kernels start in quant.cu's names: after the formats' kernels,
/// quantize_q8 and qgemm_reduce, three a width (Q4_K, Q6_K, their pair) in
/// [`QuantGemmTile::WIDE`]'s order; `None` for the other tiles.
fn wide_kernels_at(tile: QuantGemmTile) -> Option<usize> {
    let width = QuantGemmTile::WIDE.iter().position(|&w| w == tile)?;
    Some(QUANT_FORMATS.len() * KERNELS_PER_FORMAT + 2 + 3 * width)
}

/// quant.cu's kernel names (its entry in [`FAMILIES`]).
fn quant_kernels() -> &'static [&'static str] {
    FAMILIES
        .iter()
        .find(|(family, _, _)| *family == "quant")
        .map(|(_, _, names)| *names)
        .unwrap_or_default()
}

/// `y[j * ld + row] = x[j] · w[row]` over a quantized segment of `n` rows (`qgemv_{format}_t{T}`),
/// times the norm scale of `norm_in` when given.
#[derive(Debug, Clone, Copy)]
pub struct QuantGemvCall {
    pub format: QuantFormat,
    /// The segment's bytes (quant.cu's layout).
    pub w: u64,
    /// `[t, k]` as int8 blocks ([`QuantizeQ8Call`]'s `xq`).
    pub x: u64,
    /// Their scales and sums ([`QuantizeQ8Call`]'s `xs`).
    pub x_scales: u64,
    /// 1: x has the residual pass too ([`QuantizeQ8Call`]'s `two_pass`).
    pub two_pass: i32,
    /// `[t, ld]`: bf16, or f32 when `out_f32` is 1; this segment's first column.
    pub y: u64,
    pub n: i32,
    /// A multiple of the format's block.
    pub k: i32,
    /// 1 to [`GEMV_KERNEL_TOKENS`]; picks the kernel.
    pub t: i32,
    /// Elements between tokens of y.
    pub ld: i32,
    pub out_f32: i32,
    /// The sums of the norm the dot products are scaled by, or 0.
    pub norm_in: u64,
    pub eps: f32,
}

impl QuantGemvCall {
    pub fn name(&self) -> &'static str {
        self.format.kernel(Kind::Gemv, self.t)
    }

    /// A warp a row.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        (((self.n as u32).div_ceil(QGEMV_ROWS), 1, 1), GEMV_THREADS, 0)
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.x,
            self.x_scales,
            self.two_pass,
            self.y,
            self.n,
            self.k,
            self.t,
            self.ld,
            self.out_f32,
            self.norm_in,
            self.eps
        )
        .to_vec()
    }

    one_kernel_launch!("quant.cu");
}

/// `out[t, inter] = silu(gate) * up` of a quantized `[gate; up]` segment (`qgemv_silu_*`).
#[derive(Debug, Clone, Copy)]
pub struct QuantGemvSiluCall {
    pub format: QuantFormat,
    /// `2 * inter` rows, the gate's first.
    pub w: u64,
    /// As [`QuantGemvCall`]'s.
    pub x: u64,
    pub x_scales: u64,
    pub two_pass: i32,
    /// bf16 `[t, inter]`.
    pub out: u64,
    pub inter: i32,
    pub k: i32,
    pub t: i32,
    pub norm_in: u64,
    pub eps: f32,
}

impl QuantGemvSiluCall {
    pub fn name(&self) -> &'static str {
        self.format.kernel(Kind::Silu, self.t)
    }

    /// A warp a gate/up pair of rows.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        (((self.inter as u32).div_ceil(QGEMV_ROWS), 1, 1), GEMV_THREADS, 0)
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.x,
            self.x_scales,
            self.two_pass,
            self.out,
            self.inter,
            self.k,
            self.t,
            self.norm_in,
            self.eps
        )
        .to_vec()
    }

    one_kernel_launch!("quant.cu");
}

/// `res[t, n] += x · wᵀ` over a quantized matrix, `res_bf16` = the new rows times `next_norm`
/// (the next norm's weights, or 0: none), their squares into `norm_out` (`qgemv_residual_*`).
#[derive(Debug, Clone, Copy)]
pub struct QuantGemvResidualCall {
    pub format: QuantFormat,
    pub w: u64,
    /// As [`QuantGemvCall`]'s.
    pub x: u64,
    pub x_scales: u64,
    pub two_pass: i32,
    /// f32 `[t, n]`.
    pub res: u64,
    /// bf16 `[t, n]`.
    pub res_bf16: u64,
    pub norm_out: u64,
    /// f32 `[n]` or 0.
    pub next_norm: u64,
    pub n: i32,
    pub k: i32,
    pub t: i32,
}

impl QuantGemvResidualCall {
    pub fn name(&self) -> &'static str {
        self.format.kernel(Kind::Residual, self.t)
    }

    /// A warp a row.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        (((self.n as u32).div_ceil(QGEMV_ROWS), 1, 1), GEMV_THREADS, 0)
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.x,
            self.x_scales,
            self.two_pass,
            self.res,
            self.res_bf16,
            self.norm_out,
            self.next_norm,
            self.n,
            self.k,
            self.t
        )
        .to_vec()
    }

    one_kernel_launch!("quant.cu");
}

/// Rows `first..first + rows` of a quantized segment of `n` rows as bf16 `[rows, k]` at `out`
/// (`dequant_*`).
#[derive(Debug, Clone, Copy)]
pub struct DequantCall {
    pub format: QuantFormat,
    pub w: u64,
    pub out: u64,
    pub n: i32,
    pub k: i32,
    pub first: i32,
    pub rows: i32,
}

/// Threads of a `dequant_*` block, a unit each (quant.cu's DEQUANT_THREADS).
const DEQUANT_THREADS: u32 = 256;

impl DequantCall {
    pub fn name(&self) -> &'static str {
        self.format.kernel(Kind::Dequant, 0)
    }

    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let units = self.rows as u64 * (self.k as u64 / self.format.unit_len() as u64);
        (
            (units.div_ceil(DEQUANT_THREADS as u64) as u32, 1, 1),
            DEQUANT_THREADS,
            0,
        )
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.w, self.out, self.n, self.k, self.first, self.rows).to_vec()
    }

    one_kernel_launch!("quant.cu");
}

/// Rows of a quantized GEMM block's tile (quant.cu: QGEMM_ROWS, QTILE_ROWS), and the multiple
/// of columns both GEMMs take (QGEMM_K; QTILE_K divides it).
const QGEMM_ROWS: usize = 128;
pub const QGEMM_K: usize = 128;

/// Which of quant.cu's tensor-core GEMMs over quantized blocks a [`QuantGemmCall`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantGemmTile {
    /// `qgemm_*`: 128 rows x 64 tokens a block of 4 warps, k in steps of 128 columns, each warp
    /// decoding its rows in registers.
    Registers,
    /// `qgemm_tile_*`: 128 rows x 128 tokens a block of 8 warps, k in steps of 64 columns, the
    /// weights decoded once a block into shared memory.
    Shared,
    /// `qgemm_tile_*` compiled warp-specialized (QTILE_SPECIALIZED on wgmma,
    /// [`super::Kernels::shared_tile`]): the same tiles, a block of 16 warps (8 decode, 8
    /// multiply), one block an SM.
    Specialized,
    /// `qgemm_wide_*` (Q4_K and Q6_K where quant.cu has wgmma, [`super::Kernels::wide_tiles`]):
    /// 128 rows x 256 tokens a block of 8 warps, one block an SM, k in steps of 64 columns, each
    /// lane decoding its wgmma A fragments in registers.
    Wide256,
    /// `qgemm_wide64_*`: the same over 64 tokens, two blocks an SM (bench/NOTES.md v49).
    Wide64,
    /// `qgemm_wide128_*`: the same over 128 tokens, one block an SM.
    Wide128,
    /// `qgemm_wide192_*`: the same over 192 tokens, one block an SM.
    Wide192,
}

impl QuantGemmTile {
    /// The wide tiles, in quant.cu's order of their kernels.
    pub const WIDE: [QuantGemmTile; 4] = [
        QuantGemmTile::Wide256,
        QuantGemmTile::Wide64,
        QuantGemmTile::Wide128,
        QuantGemmTile::Wide192,
    ];

    /// The narrowest wide tile that takes `t` tokens in one block (the 256-token one past 192).
    pub fn wide_for(t: usize) -> QuantGemmTile {
        match t {
            0..=64 => QuantGemmTile::Wide64,
            65..=128 => QuantGemmTile::Wide128,
            129..=192 => QuantGemmTile::Wide192,
            _ => QuantGemmTile::Wide256,
        }
    }

    /// The wide tile a product of `t` tokens takes where its format has wide tiles: the narrowest
    /// that holds t up to `narrow_most` tokens (bench/NOTES.md v49), else the 256-token one past
    /// one 128-token tile unless the GEMM's own choice (`self`) is qgemm's; `None`: `self`.
    pub fn wide_choice(self, t: usize, narrow_most: usize) -> Option<QuantGemmTile> {
        if t <= narrow_most {
            Some(QuantGemmTile::wide_for(t))
        } else if t > QuantGemmTile::Shared.tokens() && self != QuantGemmTile::Registers {
            Some(QuantGemmTile::Wide256)
        } else {
            None
        }
    }

    /// The wide tile whose kernel quant.cu's `name` is (`qgemm_wide{64,128,192,}_*`), if any.
    pub fn of_wide_kernel(name: &str) -> Option<QuantGemmTile> {
        let first = wide_kernels_at(QuantGemmTile::Wide256)?;
        let at = quant_kernels().iter().position(|&k| k == name)?;
        Self::WIDE.get(at.checked_sub(first)? / 3).copied()
    }

    /// Whether this is one of the wide tiles (`qgemm_wide*`).
    pub fn is_wide(self) -> bool {
        Self::WIDE.contains(&self)
    }

    /// Tokens a block's tile takes.
    pub fn tokens(self) -> usize {
        match self {
            QuantGemmTile::Registers | QuantGemmTile::Wide64 => 64,
            QuantGemmTile::Shared | QuantGemmTile::Specialized | QuantGemmTile::Wide128 => 128,
            QuantGemmTile::Wide192 => 192,
            QuantGemmTile::Wide256 => 256,
        }
    }

    /// Columns a block takes per step (quant.cu: QGEMM_K; QTILE_K for the other tiles).
    pub fn k_step(self) -> usize {
        match self {
            QuantGemmTile::Registers => QGEMM_K,
            _ => 64,
        }
    }

    fn threads(self) -> u32 {
        match self {
            QuantGemmTile::Registers => 128,
            QuantGemmTile::Specialized => 512,
            _ => 256,
        }
    }

    /// Blocks an SM holds at once (quant.cu's launch bounds).
    fn blocks_per_sm(self) -> usize {
        match self {
            QuantGemmTile::Registers | QuantGemmTile::Shared | QuantGemmTile::Wide64 => 2,
            _ => 1,
        }
    }

    /// The steps per block that split k so that the tiles of an `n` x `t` product fill
    /// `multiprocessors` (as many times over as an SM holds blocks; at most 16 ways) in one
    /// wave, never past it: the splits round down, as a second wave of a few blocks costs as
    /// much as the first (bench/NOTES.md v38). The `[splits, t, n]` f32 partial sums stay
    /// within `parts_capacity` values.
    pub fn steps_per_split_for(
        self,
        n: usize,
        k: usize,
        t: usize,
        multiprocessors: usize,
        parts_capacity: usize,
    ) -> i32 {
        let steps = (k / self.k_step()).max(1);
        let tiles = n.div_ceil(QGEMM_ROWS) * t.div_ceil(self.tokens());
        let wanted = (self.blocks_per_sm() * multiprocessors) / tiles.max(1);
        let fits = parts_capacity / (t * n).max(1);
        let splits = wanted.min(fits).min(steps).clamp(1, 16);
        steps.div_ceil(splits) as i32
    }

    /// The wide tiles' tail of an `n` x `k` product of `t` tokens: how many of its last row
    /// tiles split k, and how many ways, so that the last wave of a product of more tiles than
    /// the SMs hold at once is not left mostly empty: the partial wave's tiles, each split as many
    /// ways as fill one wave (gate/up at 256 tokens on 132 SMs: 32 of 296 tiles, 4 ways), while
    /// their `[ways, t, rows]` f32 sums fit `parts_capacity`. `(0, 1)` for other tiles, for more
    /// tokens than a tile's, where k is split (`splits` > 1), and where fewer than 2 ways fit.
    pub fn wide_tail_for(
        self,
        (n, k, t): (usize, usize, usize),
        splits: usize,
        multiprocessors: usize,
        parts_capacity: usize,
    ) -> (i32, i32) {
        let tiles = n.div_ceil(QGEMM_ROWS);
        let slots = self.blocks_per_sm() * multiprocessors;
        let rest = tiles % slots;
        if !self.is_wide() || t > self.tokens() || splits > 1 || tiles <= slots || rest == 0 {
            return (0, 1);
        }
        let rest_rows = n - (tiles - rest) * QGEMM_ROWS;
        let ways = (slots / rest)
            .min(parts_capacity / (rest_rows * t).max(1))
            .min(k / self.k_step())
            .min(8);
        if ways < 2 {
            (0, 1)
        } else {
            (rest as i32, ways as i32)
        }
    }
}

/// `y[j * ld + row] = x[j] · w[row]` over a quantized segment of `n` rows on tensor cores, the
/// blocks decoded on the way (`qgemm_*` or `qgemm_tile_*`, [`QuantGemmTile`]): for steps of more
/// tokens than the GEMVs take. When `steps_per_split` is less than k's column steps (the
/// tile's [`QuantGemmTile::steps_per_split_for`]), each of [`Self::grid_splits`]
/// blocks per tile sums its share of them into `parts` and [`QuantGemmReduceCall`] adds the
/// shares into y.
#[derive(Debug, Clone, Copy)]
pub struct QuantGemmCall {
    pub format: QuantFormat,
    pub tile: QuantGemmTile,
    /// The segment's bytes (quant.cu's layout).
    pub w: u64,
    /// bf16 `[t, k]`.
    pub x: u64,
    /// `[t, ld]`: bf16, or f32 when `out_f32` is 1; this segment's first column.
    pub y: u64,
    /// f32 `[splits, t, n]` when k is split; `[tail_splits, t, rows of the tail]` with a tail.
    pub parts: u64,
    pub n: i32,
    /// A multiple of [`QGEMM_K`] and of the format's block.
    pub k: i32,
    pub t: i32,
    pub ld: i32,
    pub out_f32: i32,
    /// Column steps a block takes ([`QuantGemmTile::steps_per_split_for`]; all of k's steps: no
    /// split).
    pub steps_per_split: i32,
    /// The wide tiles' TMA map of x ([`Self::x_map_for`]); [`TmaMap::NONE`] elsewhere.
    pub x_map: TmaMap,
    /// The wide tiles' TMA maps of the weight planes ([`Self::w_maps_for`]); NONE elsewhere.
    pub w_maps: [TmaMap; 3],
    /// The wide tiles' last row tiles whose k is split `tail_splits` ways
    /// ([`QuantGemmTile::wide_tail_for`]); 0 elsewhere (and `tail_splits` 1).
    pub tail: i32,
    pub tail_splits: i32,
}

impl QuantGemmCall {
    pub fn name(&self) -> &'static str {
        match self.tile {
            QuantGemmTile::Registers => self.format.kernel(Kind::Gemm, 0),
            QuantGemmTile::Shared | QuantGemmTile::Specialized => self.format.kernel(Kind::GemmTile, 0),
            wide => self
                .format
                .wide_kernel(wide)
                .unwrap_or_else(|| panic!("{:?} has no wide tiles", self.format)),
        }
    }

    /// The TMA map of x the call's kernel reads: x's boxes of 64 columns x the tile's tokens
    /// where the wide tiles copy x by TMA (`tma`, [`super::Kernels::wide_tma`]), none otherwise.
    pub fn x_map_for(&self, tma: bool) -> Result<TmaMap, CudaError> {
        if !self.tile.is_wide() || !tma {
            return Ok(TmaMap::NONE);
        }
        let tokens = self.tile.tokens() as u32;
        encode_bf16_matrix_map(self.x, self.t as usize, self.k as usize, 64, tokens)
    }

    /// The TMA maps of the weight planes the call's kernel reads where the wide tiles copy their
    /// weights by TMA (`tma`, [`super::Kernels::wide_weights_by_tma`]): the segment's rows as
    /// bytes, boxes of each plane's width x 128 rows; none otherwise.
    pub fn w_maps_for(&self, tma: bool) -> Result<[TmaMap; 3], CudaError> {
        let mut maps = [TmaMap::NONE; 3];
        if !self.tile.is_wide() || !tma {
            return Ok(maps);
        }
        let (planes, block_bytes) = self.format.wide_planes();
        let row_bytes = (self.k as usize / self.format.block_len()) * block_bytes;
        for (map, &width) in maps.iter_mut().zip(planes) {
            *map = encode_byte_rows_map(self.w, self.n as usize, row_bytes, width, QGEMM_ROWS as u32)?;
        }
        Ok(maps)
    }

    /// The call with the TMA maps its kernel reads as `kernels` compiled it ([`Self::x_map_for`],
    /// [`Self::w_maps_for`]).
    pub fn with_maps(self, kernels: &super::Kernels) -> Result<Self, CudaError> {
        Ok(QuantGemmCall {
            x_map: self.x_map_for(kernels.wide_tma())?,
            w_maps: self.w_maps_for(kernels.wide_weights_by_tma())?,
            ..self
        })
    }

    /// Blocks per tile along k (1: no split, y written directly).
    pub fn grid_splits(&self) -> i32 {
        let steps = (self.k / self.tile.k_step() as i32).max(1);
        (steps as u32).div_ceil(self.steps_per_split.max(1) as u32) as i32
    }

    /// The wide tiles' tail, as launched: 0 for other tiles.
    fn wide_tail(&self) -> i32 {
        if self.tile.is_wide() {
            self.tail.max(0)
        } else {
            0
        }
    }

    /// The sum of the splits' partial sums into y, to launch after this call: of every row when
    /// k is split, of the tail's rows when the wide tiles split a tail's k; `None` when the GEMM
    /// writes y itself.
    pub fn reduce(&self) -> Option<QuantGemmReduceCall> {
        let tail = self.wide_tail();
        if tail > 0 {
            let first = ((self.n as usize).div_ceil(QGEMM_ROWS) - tail as usize) * QGEMM_ROWS;
            let elem = if self.out_f32 == 1 { 4 } else { 2 };
            return Some(QuantGemmReduceCall {
                parts: self.parts,
                y: self.y + (first * elem) as u64,
                n: self.n - first as i32,
                t: self.t,
                ld: self.ld,
                splits: self.tail_splits,
                out_f32: self.out_f32,
            });
        }
        (self.grid_splits() > 1).then_some(QuantGemmReduceCall {
            parts: self.parts,
            y: self.y,
            n: self.n,
            t: self.t,
            ld: self.ld,
            splits: self.grid_splits(),
            out_f32: self.out_f32,
        })
    }

    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let tail = self.wide_tail() as u32;
        (
            (
                (self.n as u32).div_ceil(QGEMM_ROWS as u32) - tail + tail * self.tail_splits.max(1) as u32,
                (self.t as u32).div_ceil(self.tile.tokens() as u32),
                self.grid_splits() as u32,
            ),
            self.tile.threads(),
            0,
        )
    }

    fn args(&self) -> Vec<*mut c_void> {
        let mut args = kernel_args!(
            self.w,
            self.x,
            self.y,
            self.parts,
            self.n,
            self.k,
            self.t,
            self.ld,
            self.out_f32,
            self.steps_per_split
        )
        .to_vec();
        // The wide tiles' last parameters: the tail and its splits, and the maps by value.
        if self.tile.is_wide() {
            args.extend(kernel_args!(
                self.tail,
                self.tail_splits,
                self.x_map,
                self.w_maps[0],
                self.w_maps[1],
                self.w_maps[2]
            ));
        }
        args
    }

    one_kernel_launch!("quant.cu");
}

/// Two wide-tile segments of one product in one launch (`qgemm_wide_pair_*`): a layer's QKV
/// whose v rows are Q6_K, which two launches and two reduces made twice a one-segment QKV's
/// time (bench/NOTES.md v46). `first` and `second` are the segments' calls as each would launch
/// alone (format, w, n, weight maps); `first`'s y, parts, k, t, ld, out_f32, x map and
/// steps_per_split serve both, and `second`'s rows are rows `first.n`.. of y (and of parts).
#[derive(Debug, Clone, Copy)]
pub struct QuantGemmPairCall {
    pub first: QuantGemmCall,
    pub second: QuantGemmCall,
}

impl QuantGemmPairCall {
    /// The pair of two segments, where quant.cu has a kernel for their formats (Q4_K then Q6_K),
    /// both run on the wide tiles without a tail, and the first's rows are whole 128-row tiles.
    pub fn of(first: QuantGemmCall, second: QuantGemmCall) -> Option<Self> {
        let pair = Self { first, second };
        let fits = first.tile.is_wide()
            && second.tile == first.tile
            && first.wide_tail() == 0
            && second.wide_tail() == 0
            && (first.n as usize).is_multiple_of(QGEMM_ROWS)
            && pair.kernel().is_some();
        fits.then_some(pair)
    }

    fn kernel(&self) -> Option<&'static str> {
        let at = wide_kernels_at(self.first.tile)? + 2;
        (self.first.format == QuantFormat::Q4K && self.second.format == QuantFormat::Q6K).then(|| quant_kernels()[at])
    }

    pub fn name(&self) -> &'static str {
        self.kernel()
            .unwrap_or_else(|| panic!("no wide pair of {:?} and {:?}", self.first.format, self.second.format))
    }

    /// The product's rows: both segments'.
    pub fn rows(&self) -> i32 {
        self.first.n + self.second.n
    }

    /// `first` over both segments' rows: the first's rows being whole tiles and neither having a
    /// tail ([`Self::of`]), its grid and reduce are the pair's.
    fn as_one(&self) -> QuantGemmCall {
        QuantGemmCall {
            n: self.rows(),
            ..self.first
        }
    }

    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        self.as_one().shape()
    }

    fn args(&self) -> Vec<*mut c_void> {
        let (f, s) = (&self.first, &self.second);
        let mut args = kernel_args!(
            f.w,
            s.w,
            f.x,
            f.y,
            f.parts,
            f.n,
            s.n,
            f.k,
            f.t,
            f.ld,
            f.out_f32,
            f.steps_per_split
        )
        .to_vec();
        // The maps by value, as the wide tiles take them: x's, then each segment's planes'.
        args.extend(kernel_args!(
            f.x_map,
            f.w_maps[0],
            f.w_maps[1],
            f.w_maps[2],
            s.w_maps[0],
            s.w_maps[1],
            s.w_maps[2]
        ));
        args
    }

    /// The sum of the k splits of both segments' rows.
    pub fn reduce(&self) -> Option<QuantGemmReduceCall> {
        self.as_one().reduce()
    }

    one_kernel_launch!("quant.cu");
}

/// `y[j * ld + row]` = the sum of a [`QuantGemmCall`]'s `splits` partial sums (`qgemm_reduce`).
#[derive(Debug, Clone, Copy)]
pub struct QuantGemmReduceCall {
    pub parts: u64,
    pub y: u64,
    pub n: i32,
    pub t: i32,
    pub ld: i32,
    pub splits: i32,
    pub out_f32: i32,
}

impl QuantGemmReduceCall {
    pub fn name(&self) -> &'static str {
        quant_kernels()[QUANT_FORMATS.len() * KERNELS_PER_FORMAT + 1]
    }

    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let count = self.t as u64 * self.n as u64;
        ((count.div_ceil(256) as u32, 1, 1), 256, 0)
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.parts, self.y, self.n, self.t, self.ld, self.splits, self.out_f32).to_vec()
    }

    one_kernel_launch!("quant.cu");
}

/// Values of an activation block of [`QuantizeQ8Call`].
pub const Q8_BLOCK: usize = 32;

/// `x` (bf16 `[t, k]`, k a multiple of [`Q8_BLOCK`]) as int8 blocks for the GEMVs: `xq` (`[t, k]`
/// bytes) and per block its scale and the sum of its values (`xs`, f32 pairs) (`quantize_q8`).
/// With `two_pass` (the `high` activation precision) a second pass quantizes what the first left:
/// its `[t, k]` bytes follow in `xq`, its f32 scales follow the pairs in `xs`.
#[derive(Debug, Clone, Copy)]
pub struct QuantizeQ8Call {
    pub x: u64,
    pub xq: u64,
    pub xs: u64,
    pub k: i32,
    pub t: i32,
    pub two_pass: i32,
}

/// Threads of a `quantize_q8` block, 8 values each (quant.cu's QUANTIZE_THREADS).
const QUANTIZE_THREADS: u32 = 128;

impl QuantizeQ8Call {
    pub fn name(&self) -> &'static str {
        quant_kernels()[QUANT_FORMATS.len() * KERNELS_PER_FORMAT]
    }

    /// Bytes of `xq` for `t` tokens of `k` values, room for both passes.
    pub fn value_bytes(k: usize, t: usize) -> usize {
        2 * t * k
    }

    /// Bytes of `xs` for `t` tokens of `k` values, room for both passes.
    pub fn scale_bytes(k: usize, t: usize) -> usize {
        t * k / Q8_BLOCK * (8 + 4)
    }

    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let pieces = self.t as u64 * self.k as u64 / 8;
        (
            (pieces.div_ceil(QUANTIZE_THREADS as u64) as u32, 1, 1),
            QUANTIZE_THREADS,
            0,
        )
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.x, self.xq, self.xs, self.k, self.t, self.two_pass).to_vec()
    }

    one_kernel_launch!("quant.cu");
}

/// The embeddings of `rows` tokens from a quantized table into the f32 residual
/// (`embedding_*`; embedding.cu's rule for ids outside this GPU's rows).
#[derive(Debug, Clone, Copy)]
pub struct QuantEmbeddingCall {
    pub format: QuantFormat,
    pub table: u64,
    pub tokens: u64,
    pub out: u64,
    pub hidden: i32,
    pub vocab_start: i32,
    pub vocab_rows: i32,
    pub rows: usize,
}

impl QuantEmbeddingCall {
    pub fn name(&self) -> &'static str {
        self.format.kernel(Kind::Embedding, 0)
    }

    /// One block a token.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        ((self.rows as u32, 1, 1), ROW_THREADS, 0)
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.table,
            self.tokens,
            self.out,
            self.hidden,
            self.vocab_start,
            self.vocab_rows
        )
        .to_vec()
    }

    one_kernel_launch!("quant.cu");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::arg_at as at;

    #[test]
    fn each_format_finds_its_kernels_by_position() {
        for f in QUANT_FORMATS {
            for (t, tn) in [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8)] {
                assert_eq!(f.kernel(Kind::Gemv, t), format!("qgemv_{}_t{tn}", f.name()));
                assert_eq!(f.kernel(Kind::Silu, t), format!("qgemv_silu_{}_t{tn}", f.name()));
                assert_eq!(
                    f.kernel(Kind::Residual, t),
                    format!("qgemv_residual_{}_t{tn}", f.name())
                );
            }
            assert_eq!(f.kernel(Kind::Dequant, 0), format!("dequant_{}", f.name()));
            assert_eq!(f.kernel(Kind::Embedding, 0), format!("embedding_{}", f.name()));
            assert_eq!(f.kernel(Kind::Gemm, 0), format!("qgemm_{}", f.name()));
            assert_eq!(f.kernel(Kind::GemmTile, 0), format!("qgemm_tile_{}", f.name()));
            for (tile, width) in QuantGemmTile::WIDE.into_iter().zip(["", "64", "128", "192"]) {
                let wide = f.has_wide_tiles().then(|| format!("qgemm_wide{width}_{}", f.name()));
                assert_eq!(f.wide_kernel(tile).map(str::to_string), wide);
                assert!(tile.is_wide() && tile.tokens() >= 64);
            }
            assert_eq!(f.wide_kernel(QuantGemmTile::Registers), None);
            assert_eq!(QuantGemmTile::of_wide_kernel(&format!("qgemm_{}", f.name())), None);
            assert_eq!(QuantFormat::of(f.ggml_type()), Some(f));
            assert!(f.block_len().is_multiple_of(f.unit_len()));
        }
        // Each wide kernel's name gives back its tile (kernels.rs sizes its shared memory by it).
        for (tile, width) in QuantGemmTile::WIDE.into_iter().zip(["", "64", "128", "192"]) {
            for name in ["q4_k", "q6_k", "pair_q4_k_q6_k"].map(|f| format!("qgemm_wide{width}_{f}")) {
                assert_eq!(QuantGemmTile::of_wide_kernel(&name), Some(tile), "{name}");
            }
        }
        assert_eq!(QuantGemmTile::of_wide_kernel("qgemm_reduce"), None);
        assert_eq!(
            quant_kernels().len(),
            QUANT_FORMATS.len() * KERNELS_PER_FORMAT + 2 + 3 * 4
        );
        let q = QuantizeQ8Call {
            x: 1,
            xq: 2,
            xs: 3,
            k: 4096,
            t: 3,
            two_pass: 1,
        };
        assert_eq!((q.name(), q.shape()), ("quantize_q8", ((12, 1, 1), 128, 0)));
        let want = vec![at(&q.x), at(&q.xq), at(&q.xs), at(&q.k), at(&q.t), at(&q.two_pass)];
        assert_eq!(q.args(), want);
        assert_eq!(QuantFormat::of(GgmlType::Q5_0), None);
    }

    #[test]
    fn the_quantized_gemm_splits_k_only_to_fill_the_gpu() {
        let per = |n, k, t, sms, cap| QuantGemmTile::Registers.steps_per_split_for(n, k, t, sms, cap);
        // 7B-shaped down projection at 20 tokens on 132 SMs: 28 tiles, two blocks an SM, so 148
        // steps 9 ways (252 blocks; 10 would leave 16 blocks for a second wave).
        assert_eq!(per(3584, 18944, 20, 132, 4 << 20), 17);
        // Enough tiles already: no split. Little scratch: as many as fit; none: no split.
        assert_eq!(per(37888, 3584, 256, 132, 4 << 20), 28);
        assert_eq!(per(3584, 18944, 20, 132, 3 * 20 * 3584), 50);
        assert_eq!(per(3584, 18944, 20, 132, 0), 148);
        // Never more splits than column steps, nor more than 16.
        assert_eq!(per(64, 256, 9, 132, 4 << 20), 1);
        assert_eq!(per(64, 1 << 16, 9, 132, 4 << 20), 32);
        let call = QuantGemmCall {
            format: QuantFormat::Q4K,
            tile: QuantGemmTile::Registers,
            w: 1,
            x: 2,
            y: 3,
            parts: 4,
            n: 3584,
            k: 18944,
            t: 70,
            ld: 4608,
            out_f32: 0,
            steps_per_split: 15,
            x_map: TmaMap::NONE,
            w_maps: [TmaMap::NONE; 3],
            tail: 0,
            tail_splits: 1,
        };
        // 148 steps 15 a block: 10 blocks along k, the last taking 13.
        assert_eq!((call.name(), call.shape()), ("qgemm_q4_k", ((28, 2, 10), 128, 0)));
        let fields = |c: &QuantGemmCall| {
            vec![
                at(&c.w),
                at(&c.x),
                at(&c.y),
                at(&c.parts),
                at(&c.n),
                at(&c.k),
                at(&c.t),
                at(&c.ld),
                at(&c.out_f32),
                at(&c.steps_per_split),
            ]
        };
        assert_eq!(call.args(), fields(&call));
        let reduce = call.reduce().unwrap();
        assert_eq!((reduce.parts, reduce.y, reduce.splits, reduce.ld), (4, 3, 10, 4608));
        let whole = QuantGemmCall {
            steps_per_split: 148,
            ..call
        };
        assert_eq!(whole.grid_splits(), 1);
        assert!(whole.reduce().is_none());
        // The shared-memory tiles: 128 tokens a block, k in 64-column steps, 8 warps.
        let shared = QuantGemmTile::Shared;
        // Gate/up at 256 tokens: 296 x 2 tiles fill 132 SMs twice; the down projection's 28 x 2
        // do not, and its 296 steps split 4 ways (224 blocks; 5 would be 280).
        assert_eq!(shared.steps_per_split_for(37888, 3584, 256, 132, 4 << 20), 56);
        assert_eq!(shared.steps_per_split_for(3584, 18944, 256, 132, 4 << 20), 74);
        let tiled = QuantGemmCall {
            tile: shared,
            t: 256,
            steps_per_split: 74,
            ..call
        };
        assert_eq!((tiled.name(), tiled.shape()), ("qgemm_tile_q4_k", ((28, 2, 4), 256, 0)));
        assert_eq!(tiled.args(), fields(&tiled));
        // Warp-specialized: the same kernel, 16 warps, one block an SM, so k splits to fill
        // the SMs once (the down projection's 56 tiles 2 ways: 148 steps a block).
        let specialized = QuantGemmTile::Specialized;
        assert_eq!(specialized.steps_per_split_for(3584, 18944, 256, 132, 8 << 20), 148);
        let spec_call = QuantGemmCall {
            tile: specialized,
            steps_per_split: 148,
            ..tiled
        };
        assert_eq!(
            (spec_call.name(), spec_call.shape()),
            ("qgemm_tile_q4_k", ((28, 2, 2), 512, 0))
        );
        // Wide tiles: 256 tokens a block of 8 warps, one block an SM. Gate/up's 296 tiles fill
        // the SMs as they are; the down projection's 28 split 4 ways (74 of 296 steps a block:
        // 112 blocks, where 5 ways made 140, a second wave of 8), at 224 tokens too (the
        // scratch would hold 5 shares), and QKV's 36 tiles 3 ways (108 blocks, not 144).
        let wide = QuantGemmTile::Wide256;
        assert_eq!(wide.steps_per_split_for(37888, 3584, 256, 132, 8 << 20), 56);
        assert_eq!(wide.steps_per_split_for(3584, 18944, 256, 132, 8 << 20), 74);
        assert_eq!(wide.steps_per_split_for(3584, 18944, 224, 132, 4 << 20), 74);
        assert_eq!(wide.steps_per_split_for(4608, 3584, 224, 132, 4 << 20), 19);
        let wide_call = QuantGemmCall {
            tile: wide,
            steps_per_split: 74,
            ..tiled
        };
        assert_eq!(
            (wide_call.name(), wide_call.shape()),
            ("qgemm_wide_q4_k", ((28, 1, 4), 256, 0))
        );
        // Their kernel takes the tail and its splits, then the TMA maps of x and of the weight
        // planes by value (unused unless built with QWIDE_TMA, QWIDE_W_TMA).
        let mut want = fields(&wide_call);
        want.extend([at(&wide_call.tail), at(&wide_call.tail_splits), at(&wide_call.x_map)]);
        want.extend(wide_call.w_maps.iter().map(at));
        assert_eq!(wide_call.args(), want);
        // Gate/up at 256 tokens: 296 tiles, two whole waves, then 32 tiles whose k splits 4 ways
        // (128 blocks), their [4, 256, 4096] sums filling the 4 M values of parts exactly.
        let tail = |n, k, t, splits, cap| wide.wide_tail_for((n, k, t), splits, 132, cap);
        assert_eq!(tail(37888, 3584, 256, 1, 4 << 20), (32, 4));
        let gate_up = QuantGemmCall {
            n: 37888,
            k: 3584,
            steps_per_split: 56,
            tail: 32,
            tail_splits: 4,
            ..wide_call
        };
        assert_eq!(gate_up.shape(), ((264 + 128, 1, 1), 256, 0));
        assert_eq!(gate_up.args()[10], at(&gate_up.tail));
        // Its reduce adds the tail's rows (264 x 128 on) only, into their columns of y.
        let r = gate_up.reduce().unwrap();
        assert_eq!(
            (r.parts, r.n, r.t, r.ld, r.splits),
            (4, 37888 - 264 * 128, 256, 4608, 4)
        );
        assert_eq!(r.y, 3 + 2 * 264 * 128);
        // 3 ways where parts holds only 3 shares; 2 for a partial wave of 64 tiles; none where
        // fewer than 2 fit (100 left over on 132 SMs), past 256 tokens, with k split, with no
        // more tiles than SMs or a whole number of waves, nor on the other tiles.
        assert_eq!(tail(37888, 3584, 256, 1, 3 << 20), (32, 3));
        assert_eq!(tail(196 * 128, 3584, 256, 1, 4 << 20), (64, 2));
        assert_eq!(tail(232 * 128, 3584, 256, 1, 4 << 20), (0, 1));
        assert_eq!(tail(37888, 3584, 257, 1, 4 << 20), (0, 1));
        assert_eq!(tail(37888, 3584, 256, 2, 4 << 20), (0, 1));
        assert_eq!(tail(3584, 3584, 256, 1, 4 << 20), (0, 1));
        assert_eq!(tail(264 * 128, 3584, 256, 1, 4 << 20), (0, 1));
        assert_eq!(shared.wide_tail_for((37888, 3584, 256), 1, 132, 4 << 20), (0, 1));
        // The narrow wide tiles (NOTES v49) take products of up to 192 tokens: 64-token tiles two
        // blocks an SM, 128- and 192-token ones one. At 32 tokens o's 28 tiles split k 9 ways (7
        // of 56 steps a block: 8 blocks a tile, 224 of 264 slots; 4 ways on the 128-token tiles),
        // and gate/up's 296 tiles leave 32 past the 264 slots, split 8 ways.
        let wide_for: Vec<QuantGemmTile> = [9, 64, 65, 128, 129, 192, 193].map(QuantGemmTile::wide_for).to_vec();
        use QuantGemmTile::{Wide128, Wide192, Wide256, Wide64};
        assert_eq!(wide_for, [Wide64, Wide64, Wide128, Wide128, Wide192, Wide192, Wide256]);
        // The routing (STRATA_QUANT_WIDE_NARROW): up to 192 tokens by default; 0 keeps qgemm to
        // 128 tokens and the 256-token tiles past them (none where the GEMM stays on qgemm);
        // 128 sends 129-192 tokens to the 256-token tiles.
        let (registers, shared) = (QuantGemmTile::Registers, QuantGemmTile::Shared);
        assert_eq!(registers.wide_choice(9, 192), Some(Wide64));
        assert_eq!(registers.wide_choice(100, 192), Some(Wide128));
        assert_eq!(shared.wide_choice(150, 192), Some(Wide192));
        assert_eq!(shared.wide_choice(200, 192), Some(Wide256));
        assert_eq!(registers.wide_choice(100, 0), None);
        assert_eq!(shared.wide_choice(128, 0), None);
        assert_eq!(shared.wide_choice(129, 0), Some(Wide256));
        assert_eq!(registers.wide_choice(200, 0), None);
        assert_eq!(shared.wide_choice(150, 128), Some(Wide256));
        assert_eq!(Wide64.steps_per_split_for(3584, 3584, 32, 132, 4 << 20), 7);
        assert_eq!(Wide128.steps_per_split_for(3584, 3584, 100, 132, 4 << 20), 14);
        assert_eq!(Wide64.wide_tail_for((37888, 3584, 32), 1, 132, 4 << 20), (32, 8));
        assert_eq!(Wide64.wide_tail_for((37888, 3584, 65), 1, 132, 4 << 20), (0, 1));
        let narrow = QuantGemmCall {
            tile: Wide64,
            t: 32,
            tail: 32,
            tail_splits: 8,
            ..gate_up
        };
        assert_eq!(narrow.name(), "qgemm_wide64_q4_k");
        assert_eq!(narrow.shape(), ((264 + 256, 1, 1), 256, 0));
        assert_eq!(narrow.args().len(), wide_call.args().len());
        assert_eq!(wide_call.x_map_for(false).unwrap(), TmaMap::NONE);
        assert_eq!(wide_call.w_maps_for(false).unwrap(), [TmaMap::NONE; 3]);
        assert_eq!(tiled.w_maps_for(true).unwrap(), [TmaMap::NONE; 3]);
        // The planes: Q4_K's heads and nibbles, Q6_K's low bits, high bits and scales.
        assert_eq!(QuantFormat::Q4K.wide_planes(), (&[16u32, 32][..], 144));
        assert_eq!(QuantFormat::Q6K.wide_planes(), (&[64u32, 32, 16][..], 208));
        assert_eq!(tiled.x_map_for(true).unwrap(), TmaMap::NONE);
        // A QKV of 4096 Q4_K rows and 512 Q6_K rows at 224 tokens: one launch of 32 + 4 tiles,
        // k split as a 4608-row product's (3 ways), both segments' rows in one reduce.
        let q4 = QuantGemmCall {
            n: 4096,
            k: 3584,
            t: 224,
            steps_per_split: 19,
            ..wide_call
        };
        let q6 = QuantGemmCall {
            format: QuantFormat::Q6K,
            w: 20,
            n: 512,
            ..q4
        };
        let pair = QuantGemmPairCall::of(q4, q6).expect("Q4_K then Q6_K on the wide tiles");
        assert_eq!(
            (pair.name(), pair.shape(), pair.rows()),
            ("qgemm_wide_pair_q4_k_q6_k", ((36, 1, 3), 256, 0), 4608)
        );
        // Both segments' bytes and rows, the first's other fields, then the maps by value.
        let (pf, ps) = (&pair.first, &pair.second);
        let mut want = vec![
            at(&pf.w),
            at(&ps.w),
            at(&pf.x),
            at(&pf.y),
            at(&pf.parts),
            at(&pf.n),
            at(&ps.n),
        ];
        want.extend([
            at(&pf.k),
            at(&pf.t),
            at(&pf.ld),
            at(&pf.out_f32),
            at(&pf.steps_per_split),
        ]);
        want.push(at(&pf.x_map));
        want.extend(pf.w_maps.iter().chain(&ps.w_maps).map(at));
        assert_eq!(pair.args(), want);
        let r = pair.reduce().unwrap();
        assert_eq!((r.y, r.n, r.t, r.ld, r.splits), (q4.y, 4608, 224, 4608, 3));
        // No pair in the other order, with a first segment of part of a tile, a tail, or off
        // the wide tiles.
        assert!(QuantGemmPairCall::of(q6, q4).is_none());
        assert!(QuantGemmPairCall::of(QuantGemmCall { n: 4000, ..q4 }, q6).is_none());
        assert!(QuantGemmPairCall::of(QuantGemmCall { tail: 2, ..q4 }, q6).is_none());
        assert!(QuantGemmPairCall::of(QuantGemmCall { tile: shared, ..q4 }, q6).is_none());
    }

    #[test]
    #[should_panic(expected = "no quantized GEMV is compiled for 9 tokens")]
    fn a_quantized_gemv_past_the_compiled_tokens_is_a_bug() {
        QuantFormat::Q4K.kernel(Kind::Gemv, 9);
    }

    #[test]
    fn planar_formats_move_their_fields_after_the_bodies() {
        // Two rows of two Q4_0 blocks (18 bytes: d, then 16 bytes), rows 1..2 of a 3-row segment.
        let block = |tag: u8| -> Vec<u8> { (0..18).map(|i| tag * 32 + i).collect() };
        let blocks: Vec<u8> = [1, 2, 3, 4].iter().flat_map(|&t| block(t)).collect();
        let mut dev = [0u8; 3 * 2 * 18];
        QuantFormat::Q4_0.place_rows(&blocks, 2, 1, 3, &mut |at, b| dev[at..at + b.len()].copy_from_slice(b));
        // Bodies of rows 1 and 2 after row 0's 32 bytes, fields after all 3 * 2 bodies.
        assert_eq!(&dev[32..48], &block(1)[2..]);
        assert_eq!(&dev[80..96], &block(4)[2..]);
        assert_eq!(&dev[96 + 4..96 + 6], &block(1)[..2]);
        assert_eq!(&dev[96 + 10..96 + 12], &block(4)[..2]);
        assert!(dev[..32].iter().all(|&b| b == 0));
        // Q4_K keeps the file's blocks.
        let k: Vec<u8> = (0..144u32).map(|i| i as u8).collect();
        let mut dev = [0u8; 2 * 144];
        QuantFormat::Q4K.place_rows(&k, 1, 1, 2, &mut |at, b| dev[at..at + b.len()].copy_from_slice(b));
        assert_eq!(&dev[144..], &k[..]);
    }

    #[test]
    fn the_quantized_calls_pass_quant_cu_arguments_in_order() {
        let c = QuantGemvCall {
            format: QuantFormat::Q6K,
            w: 1,
            x: 2,
            x_scales: 8,
            two_pass: 1,
            y: 3,
            n: 7,
            k: 256,
            t: 3,
            ld: 9,
            out_f32: 1,
            norm_in: 4,
            eps: 0.5,
        };
        let want = vec![
            at(&c.w),
            at(&c.x),
            at(&c.x_scales),
            at(&c.two_pass),
            at(&c.y),
            at(&c.n),
            at(&c.k),
            at(&c.t),
            at(&c.ld),
            at(&c.out_f32),
            at(&c.norm_in),
            at(&c.eps),
        ];
        assert_eq!(c.args(), want);
        assert_eq!((c.name(), c.shape()), ("qgemv_q6_k_t4", ((2, 1, 1), 128, 0)));
        let r = QuantGemvResidualCall {
            format: QuantFormat::Q4_0,
            w: 1,
            x: 2,
            x_scales: 7,
            two_pass: 0,
            res: 3,
            res_bf16: 4,
            norm_out: 5,
            next_norm: 6,
            n: 10,
            k: 64,
            t: 1,
        };
        let want = vec![
            at(&r.w),
            at(&r.x),
            at(&r.x_scales),
            at(&r.two_pass),
            at(&r.res),
            at(&r.res_bf16),
            at(&r.norm_out),
            at(&r.next_norm),
            at(&r.n),
            at(&r.k),
            at(&r.t),
        ];
        assert_eq!(r.args(), want);
        assert_eq!((r.name(), r.shape()), ("qgemv_residual_q4_0_t1", ((3, 1, 1), 128, 0)));
        let d = DequantCall {
            format: QuantFormat::Q4K,
            w: 1,
            out: 2,
            n: 3,
            k: 512,
            first: 1,
            rows: 2,
        };
        let want = vec![at(&d.w), at(&d.out), at(&d.n), at(&d.k), at(&d.first), at(&d.rows)];
        assert_eq!(d.args(), want);
        assert_eq!((d.name(), d.shape()), ("dequant_q4_k", ((1, 1, 1), 256, 0)));
    }
}
