//! The forward pass of a llama-family decoder on the CPU backend, over a batch of sequences.
//! Reads and writes the paged KV cache; returns logits only for the positions asked for.

use strata_runtime::cpu::ops;
use strata_runtime::cpu::quant_dot::WeightLayout;
use strata_runtime::cpu::{matmul, matmul_many, ActPrecision, DisjointMut, MatmulScratch, RowPaths, ThreadPool};

use crate::batch::{Logits, LogitsWanted, SeqChunk};
use crate::config::{rope_cos_sin, ModelConfig};
use crate::error::ModelError;
use crate::kv_cache::PagedKvCache;
use crate::prompt_attention::{PromptTile, TILE_SCRATCH, TILE_TOKENS};
use crate::weights::ModelWeights;

/// A loaded model ready to run.
pub struct Transformer {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    /// Activation precision of the quantized (decode) path; see [`ActPrecision`].
    pub act_precision: ActPrecision,
    inv_freq: Vec<f32>,
}

/// Buffers reused across forward passes.
#[derive(Default, Debug)]
pub struct ForwardScratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    matmul: MatmulScratch,
    /// A logits buffer handed back by [`ForwardScratch::recycle`], reused by the next pass.
    spare_logits: Vec<f32>,
}

impl ForwardScratch {
    /// Gives the buffer of consumed logits back so the next forward pass need not allocate
    /// (and fault in) a fresh vocabulary-sized buffer.
    pub fn recycle(&mut self, logits: Logits) {
        self.spare_logits = logits.data;
    }
}

/// Where each flat token of the batch belongs. Prompt tokens of all sequences come first (dense
/// path), then generated tokens (quantized path); see [`SeqChunk::prompt_len`].
struct TokenSlot {
    seq: usize,
    pos: usize,
    token: u32,
}

/// The flat token order of a batch: prompt tokens first, then generated ones.
struct FlatBatch {
    slots: Vec<TokenSlot>,
    paths: RowPaths,
    /// Per sequence: flat index of its first prompt token and of its first generated token.
    starts: Vec<(usize, usize)>,
}

impl FlatBatch {
    fn new(batch: &[SeqChunk]) -> FlatBatch {
        let dense: usize = batch.iter().map(SeqChunk::prompt_tokens).sum();
        let total: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let mut slots = Vec::with_capacity(total);
        let mut starts = Vec::with_capacity(batch.len());
        let mut generated_at = dense;
        for (seq, ch) in batch.iter().enumerate() {
            starts.push((slots.len(), generated_at));
            generated_at += ch.tokens.len() - ch.prompt_tokens();
            let prompt = ch.tokens.iter().take(ch.prompt_tokens()).enumerate();
            slots.extend(prompt.map(|(i, &token)| TokenSlot {
                seq,
                pos: ch.first_pos + i,
                token,
            }));
        }
        for (seq, ch) in batch.iter().enumerate() {
            let p = ch.prompt_tokens();
            slots.extend(ch.tokens[p..].iter().enumerate().map(|(i, &token)| TokenSlot {
                seq,
                pos: ch.first_pos + p + i,
                token,
            }));
        }
        FlatBatch {
            slots,
            paths: RowPaths {
                dense,
                quantized: total - dense,
                precision: ActPrecision::High,
            },
            starts,
        }
    }

    /// Flat index of sequence `seq`'s token at `pos`.
    fn index(&self, batch: &[SeqChunk], seq: usize, pos: usize) -> usize {
        let ch = &batch[seq];
        let split = ch.first_pos + ch.prompt_tokens();
        if pos < split {
            self.starts[seq].0 + pos - ch.first_pos
        } else {
            self.starts[seq].1 + pos - split
        }
    }
}

impl Transformer {
    /// Builds the model from its shape and weights.
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Transformer {
        let inv_freq = config.rope.inv_freq();
        Transformer {
            config,
            weights,
            act_precision: ActPrecision::High,
            inv_freq,
        }
    }

    /// How the rows of a batch go through the products of `ws` (one call's matrices).
    /// Generated rows take the integer kernels; prompt rows the f32 GEMM, except at `standard`
    /// precision when every matrix of the call is stored in row groups: those integer kernels
    /// (8-bit activations, as llama.cpp's prompts get) outrun the GEMM (bench/NOTES.md, issues
    /// 31 and 30's Q4_K). A row's path follows from its kind and the matrix, never from the batch.
    fn matmul_paths(&self, flat: &FlatBatch, ws: &[&crate::weights::Linear]) -> RowPaths {
        let grouped = ws.iter().all(|l| l.layout == WeightLayout::RowGroups8);
        if self.act_precision == ActPrecision::Standard && grouped {
            RowPaths::quantized(flat.paths.total()).with_precision(ActPrecision::Standard)
        } else {
            flat.paths.with_precision(self.act_precision)
        }
    }

    /// Checks a batch against the model and the cache before anything is computed.
    fn validate(&self, batch: &[SeqChunk], kv: &PagedKvCache) -> Result<(), ModelError> {
        let c = &self.config;
        if kv.n_layers != c.n_layers || kv.n_kv_heads != c.n_kv_heads || kv.head_dim != c.head_dim {
            return Err(ModelError::BadBatch("KV cache was made for another model shape".into()));
        }
        for (i, s) in batch.iter().enumerate() {
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(ModelError::BadBatch(format!(
                    "sequence {i}: token id {t} is outside the vocabulary of {}",
                    c.vocab_size
                )));
            }
            let need = s.end_pos().div_ceil(kv.block_size);
            if s.block_table.len() < need {
                return Err(ModelError::BadBatch(format!(
                    "sequence {i}: block table has {} blocks, positions up to {} need {need}",
                    s.block_table.len(),
                    s.end_pos()
                )));
            }
            if let Some(&b) = s.block_table[..need].iter().find(|&&b| b as usize >= kv.num_blocks) {
                return Err(ModelError::BadBatch(format!(
                    "sequence {i}: block {b} is outside the cache of {} blocks",
                    kv.num_blocks
                )));
            }
        }
        Ok(())
    }

    /// Runs the batch: appends every new token's K/V to the cache and returns the logits asked for.
    pub fn forward(
        &self,
        batch: &[SeqChunk],
        kv: &mut PagedKvCache,
        pool: &ThreadPool,
        s: &mut ForwardScratch,
    ) -> Result<Logits, ModelError> {
        self.validate(batch, kv)?;
        let c = &self.config;
        let w = &self.weights;
        let (h, qd, kvd, hd) = (c.hidden, c.q_dim(), c.kv_dim(), c.head_dim);
        let flat = FlatBatch::new(batch);
        let slots = &flat.slots;
        let t = slots.len();
        if t == 0 {
            return Ok(Logits {
                vocab: c.vocab_size,
                ..Default::default()
            });
        }
        for (buf, len) in [
            (&mut s.x, t * h),
            (&mut s.xn, t * h),
            (&mut s.q, t * qd),
            (&mut s.k, t * kvd),
            (&mut s.v, t * kvd),
            (&mut s.attn, t * qd),
            (&mut s.proj, t * h),
            (&mut s.gate, t * c.intermediate),
            (&mut s.up, t * c.intermediate),
        ] {
            buf.resize(len, 0.0);
        }

        // Token embeddings.
        for (i, slot) in slots.iter().enumerate() {
            w.row_f32(&w.token_embd, slot.token as usize, &mut s.x[i * h..(i + 1) * h]);
        }
        // RoPE angles of every token's position, computed once for all layers.
        let half = self.inv_freq.len();
        s.cos.resize(t * half, 0.0);
        s.sin.resize(t * half, 0.0);
        for (i, slot) in slots.iter().enumerate() {
            for (j, (cos, sin)) in rope_cos_sin(&self.inv_freq, slot.pos).enumerate() {
                s.cos[i * half + j] = cos;
                s.sin[i * half + j] = sin;
            }
        }

        for (li, lw) in w.layers.iter().enumerate() {
            // Attention block.
            norm_rows(pool, &s.x, &lw.attn_norm, c.rms_eps, h, &mut s.xn);
            let qkv = [w.matrix(&lw.wq), w.matrix(&lw.wk), w.matrix(&lw.wv)];
            matmul_many(
                pool,
                &qkv,
                &s.xn,
                self.matmul_paths(&flat, &[&lw.wq, &lw.wk, &lw.wv]),
                &mut [&mut s.q, &mut s.k, &mut s.v],
                &mut s.matmul,
            );
            for (i, slot) in slots.iter().enumerate() {
                let (q, k, v) = (
                    &mut s.q[i * qd..(i + 1) * qd],
                    &mut s.k[i * kvd..(i + 1) * kvd],
                    &mut s.v[i * kvd..(i + 1) * kvd],
                );
                if let (Some(bq), Some(bk), Some(bv)) = (&lw.bq, &lw.bk, &lw.bv) {
                    ops::add_inplace(q, bq);
                    ops::add_inplace(k, bk);
                    ops::add_inplace(v, bv);
                }
                if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                    q.chunks_exact_mut(hd)
                        .for_each(|head| ops::rms_norm_inplace(head, qn, c.rms_eps));
                    k.chunks_exact_mut(hd)
                        .for_each(|head| ops::rms_norm_inplace(head, kn, c.rms_eps));
                }
                let (cos, sin) = (&s.cos[i * half..(i + 1) * half], &s.sin[i * half..(i + 1) * half]);
                ops::rope(q, hd, cos, sin, c.rope.layout);
                ops::rope(k, hd, cos, sin, c.rope.layout);
                let table = &batch[slot.seq].block_table;
                let block = table[slot.pos / kv.block_size] as usize;
                kv.write(li, block, slot.pos % kv.block_size, k, v);
            }
            self.attention(pool, li, batch, &flat, kv, &s.q, &mut s.attn);
            let paths = self.matmul_paths(&flat, &[&lw.wo]);
            matmul(pool, &w.matrix(&lw.wo), &s.attn, paths, &mut s.proj, &mut s.matmul);
            ops::add_inplace(&mut s.x, &s.proj);

            // Feed-forward block.
            norm_rows(pool, &s.x, &lw.ffn_norm, c.rms_eps, h, &mut s.xn);
            let gate_up = [w.matrix(&lw.w_gate), w.matrix(&lw.w_up)];
            matmul_many(
                pool,
                &gate_up,
                &s.xn,
                self.matmul_paths(&flat, &[&lw.w_gate, &lw.w_up]),
                &mut [&mut s.gate, &mut s.up],
                &mut s.matmul,
            );
            ops::silu_mul(&mut s.gate, &s.up);
            let paths = self.matmul_paths(&flat, &[&lw.w_down]);
            matmul(pool, &w.matrix(&lw.w_down), &s.gate, paths, &mut s.proj, &mut s.matmul);
            ops::add_inplace(&mut s.x, &s.proj);
        }

        // Logits for the positions asked for.
        let mut rows = Vec::new();
        for (si, ch) in batch.iter().enumerate() {
            let positions = match ch.logits {
                LogitsWanted::None => continue,
                LogitsWanted::Last | LogitsWanted::LastArgmax | LogitsWanted::LastSampled(_) => {
                    ch.end_pos() - 1..ch.end_pos()
                }
                LogitsWanted::All | LogitsWanted::AllArgmax => ch.first_pos..ch.end_pos(),
            };
            rows.extend(positions.map(|p| (si, p, flat.index(batch, si, p))));
        }
        let r = rows.len();
        let mut normed = vec![0.0; r * h];
        for (j, &(_, _, ti)) in rows.iter().enumerate() {
            ops::rms_norm(
                &s.x[ti * h..(ti + 1) * h],
                &w.output_norm,
                c.rms_eps,
                &mut normed[j * h..(j + 1) * h],
            );
        }
        let mut data = std::mem::take(&mut s.spare_logits);
        data.resize(r * c.vocab_size, 0.0);
        // Logits rows always take the quantized path: one path for every row, whatever its kind.
        let lm_paths = RowPaths::quantized(r).with_precision(self.act_precision);
        matmul(pool, &w.matrix(&w.lm_head), &normed, lm_paths, &mut data, &mut s.matmul);
        Ok(Logits {
            rows: rows.iter().map(|&(si, p, _)| (si, p)).collect(),
            vocab: c.vocab_size,
            data,
            argmax: vec![],
        })
    }

    /// Causal attention of every new token over its sequence's cached context: prompt tokens
    /// in tiles of consecutive tokens of one sequence ([`PromptTile`]), generated tokens one by
    /// one ([`DecodeAttention`]); one task per (tile or token, KV head).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        pool: &ThreadPool,
        layer: usize,
        batch: &[SeqChunk],
        flat: &FlatBatch,
        kv: &PagedKvCache,
        q: &[f32],
        out: &mut [f32],
    ) {
        let c = &self.config;
        let (nh, hd) = (c.n_heads, c.head_dim);
        let group = c.n_heads / c.n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let out = DisjointMut::new(out);
        let slots = &flat.slots;
        // A token's result depends only on its kind (prompt or generated) and its own context,
        // never on how the prompt was chunked or what else is batched.
        let max_ctx = slots.iter().map(|s| s.pos + 1).max().unwrap_or(0);
        let n_kv = c.n_kv_heads;
        // Prompt tiles (first flat index, tokens), longest context first so the dynamic
        // schedule ends on short ones.
        let mut tiles: Vec<(usize, usize)> = Vec::new();
        for (seq, ch) in batch.iter().enumerate() {
            let (start, n) = (flat.starts[seq].0, ch.prompt_tokens());
            tiles.extend((0..n).step_by(TILE_TOKENS).map(|t| (start + t, TILE_TOKENS.min(n - t))));
        }
        tiles.sort_by_key(|&(first, _)| std::cmp::Reverse(slots[first].pos));
        let tile_tasks = tiles.len() * n_kv;
        let dense = flat.paths.dense;
        let avx2 = simd_available();
        pool.parallel_for(tile_tasks + (slots.len() - dense) * n_kv, 1, &|range| {
            let mut scores = Vec::new();
            let mut block_buf = vec![0.0f32; kv.block_size * hd];
            for task in range {
                if task < tile_tasks {
                    let ((first, tokens), kvh) = (tiles[task / n_kv], task % n_kv);
                    let slot = &slots[first];
                    let tile = PromptTile {
                        kv,
                        layer,
                        kvh,
                        table: &batch[slot.seq].block_table,
                        first_pos: slot.pos,
                        tokens,
                        group,
                        scale,
                    };
                    let head = |t: usize, g: usize| ((first + t) * nh + kvh * group + g) * hd;
                    TILE_SCRATCH.with_borrow_mut(|scratch| {
                        tile.run(
                            |t, g| &q[head(t, g)..head(t, g) + hd],
                            // SAFETY: the heads of one (token, KV head) pair are disjoint between tasks.
                            |t, g, o| unsafe { out.range_mut(head(t, g)..head(t, g) + hd) }.copy_from_slice(o),
                            scratch,
                        )
                    });
                    continue;
                }
                let task = task - tile_tasks;
                let (ti, kvh) = (dense + task / n_kv, task % n_kv);
                scores.resize(group * max_ctx, 0.0);
                let slot = &slots[ti];
                let heads = kvh * group..(kvh + 1) * group;
                let qs = &q[(ti * nh + heads.start) * hd..(ti * nh + heads.end) * hd];
                // SAFETY: the heads of one (token, KV head) pair are disjoint between tasks.
                let o = unsafe { out.range_mut((ti * nh + heads.start) * hd..(ti * nh + heads.end) * hd) };
                let task = DecodeAttention {
                    kv,
                    layer,
                    kvh,
                    table: &batch[slot.seq].block_table,
                    ctx: slot.pos + 1,
                    group,
                    scale,
                };
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: the CPU has AVX2 and FMA (checked by `simd_available`).
                    unsafe { task.run_avx2(qs, &mut scores, &mut block_buf, o) };
                    continue;
                }
                let _ = avx2;
                task.run(qs, &mut scores, &mut block_buf, o);
            }
        });
    }
}

/// Whether the CPU runs the AVX2+FMA builds of the small attention loops.
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Query heads of a group that [`DecodeAttention`] takes together (accumulators in registers).
const GROUP_TILE: usize = 4;

/// `$f::<G>(args)` with `G` = `$gn` heads (the last tile of a group), at most [`GROUP_TILE`].
macro_rules! per_group_tile {
    ($gn:expr, $f:ident($($a:expr),*)) => {
        match $gn {
            1 => $f::<1>($($a),*),
            2 => $f::<2>($($a),*),
            3 => $f::<3>($($a),*),
            _ => $f::<GROUP_TILE>($($a),*),
        }
    };
}

/// Scores of `G` query heads (`qs`, `G` rows of `hd`) against the keys of one block (`keys`,
/// rows of `hd`) into `scores[g * stride + j]`: each key is read once for the `G` heads, and
/// each score is summed as [`ops::dot`] sums it.
#[inline(always)]
fn block_scores<const G: usize>(qs: &[f32], keys: &[f32], hd: usize, scale: f32, scores: &mut [f32], stride: usize) {
    let chunks = hd / 8;
    for (j, key) in keys.chunks_exact(hd).enumerate() {
        let mut acc = [[0.0f32; 8]; G];
        for c in 0..chunks {
            let kc: &[f32; 8] = key[c * 8..c * 8 + 8].try_into().expect("8 values");
            for (g, a) in acc.iter_mut().enumerate() {
                let qc: &[f32; 8] = qs[g * hd + c * 8..g * hd + c * 8 + 8].try_into().expect("8 values");
                for l in 0..8 {
                    a[l] += qc[l] * kc[l];
                }
            }
        }
        for (g, a) in acc.iter().enumerate() {
            let mut sum = a.iter().sum::<f32>();
            for d in chunks * 8..hd {
                sum += qs[g * hd + d] * key[d];
            }
            scores[g * stride + j] = sum * scale;
        }
    }
}

/// `o[g] += sum_j p[g][j] v[j]` for `G` query heads over the values of one block (`vals`, rows
/// of `hd`; `p[g][j]` at `probs[g * stride + j]`), each 8-dim chunk summed in registers over the
/// block, keys in order (as repeated [`ops::axpy`] sums it).
#[inline(always)]
fn block_values<const G: usize>(probs: &[f32], stride: usize, vals: &[f32], hd: usize, o: &mut [f32]) {
    let n = vals.len() / hd;
    for c in 0..hd.div_ceil(8) {
        let width = 8.min(hd - c * 8);
        if width < 8 {
            for g in 0..G {
                for j in 0..n {
                    let p = probs[g * stride + j];
                    for d in c * 8..hd {
                        o[g * hd + d] += p * vals[j * hd + d];
                    }
                }
            }
            continue;
        }
        let mut acc = [[0.0f32; 8]; G];
        for (g, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&o[g * hd + c * 8..g * hd + c * 8 + 8]);
        }
        for j in 0..n {
            let vc: &[f32; 8] = vals[j * hd + c * 8..j * hd + c * 8 + 8].try_into().expect("8 values");
            for (g, a) in acc.iter_mut().enumerate() {
                let p = probs[g * stride + j];
                for l in 0..8 {
                    a[l] += p * vc[l];
                }
            }
        }
        for (g, a) in acc.iter().enumerate() {
            o[g * hd + c * 8..g * hd + c * 8 + 8].copy_from_slice(a);
        }
    }
}

/// Attention of the query heads sharing one KV head, for one new token, over the paged cache.
struct DecodeAttention<'a> {
    kv: &'a PagedKvCache,
    layer: usize,
    kvh: usize,
    table: &'a [u32],
    ctx: usize,
    group: usize,
    scale: f32,
}

impl DecodeAttention<'_> {
    /// `o` (group x head_dim) = softmax(q K^T * scale) V; `scores` holds group x ctx values,
    /// `buf` one block of one head (for caches that decode on read).
    ///
    /// Each key is read once for up to [`GROUP_TILE`] query heads and each value chunk of 8
    /// dims accumulates in registers over a whole block; every score and output value is summed
    /// in the same order as [`ops::dot`] and [`ops::axpy`] over the keys would sum it (lanes
    /// `d mod 8` over the chunks, then the lanes in order; keys in order), so the result of a
    /// token does not depend on how its neighbours are batched.
    #[inline(always)]
    fn run(&self, qs: &[f32], scores: &mut [f32], buf: &mut [f32], o: &mut [f32]) {
        let (hd, bs, ctx, group) = (self.kv.head_dim, self.kv.block_size, self.ctx, self.group);
        let stride = scores.len() / group;
        let blocks = &self.table[..ctx.div_ceil(bs)];
        for (b, &block) in blocks.iter().enumerate() {
            if let Some(&next) = blocks.get(b + 1) {
                self.kv.prefetch_block(self.layer, next as usize, self.kvh, false);
            } else {
                self.kv.prefetch_block(self.layer, blocks[0] as usize, self.kvh, true);
            }
            let keys = self.kv.k_block(self.layer, block as usize, self.kvh, buf);
            let n = bs.min(ctx - b * bs);
            for g0 in (0..group).step_by(GROUP_TILE) {
                let at = g0 * stride + b * bs;
                let (q, k) = (&qs[g0 * hd..], &keys[..n * hd]);
                per_group_tile!(
                    group - g0,
                    block_scores(q, k, hd, self.scale, &mut scores[at..], stride)
                );
            }
        }
        o.fill(0.0);
        for g in 0..group {
            ops::softmax_inplace(&mut scores[g * stride..g * stride + ctx]);
        }
        for (b, &block) in blocks.iter().enumerate() {
            if let Some(&next) = blocks.get(b + 1) {
                self.kv.prefetch_block(self.layer, next as usize, self.kvh, true);
            }
            let vals = self.kv.v_block(self.layer, block as usize, self.kvh, buf);
            let n = bs.min(ctx - b * bs);
            for g0 in (0..group).step_by(GROUP_TILE) {
                let at = g0 * stride + b * bs;
                let og = &mut o[g0 * hd..];
                per_group_tile!(group - g0, block_values(&scores[at..], stride, &vals[..n * hd], hd, og));
            }
        }
    }

    /// [`Self::run`] compiled for AVX2 and FMA (the loops are small and hot in decode).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, qs: &[f32], scores: &mut [f32], buf: &mut [f32], o: &mut [f32]) {
        self.run(qs, scores, buf, o)
    }
}

/// RMSNorm of each of the rows of `x` (`dim` values each) into `out`.
fn norm_rows(pool: &ThreadPool, x: &[f32], weight: &[f32], eps: f32, dim: usize, out: &mut [f32]) {
    let rows = x.len() / dim;
    let o = DisjointMut::new(out);
    pool.parallel_for(rows, 32, &|range| {
        for r in range {
            // SAFETY: rows are disjoint between threads.
            let dst = unsafe { o.range_mut(r * dim..(r + 1) * dim) };
            ops::rms_norm(&x[r * dim..(r + 1) * dim], weight, eps, dst);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::kv_cache::KvCacheDtype;

    /// The plain order `DecodeAttention` must keep: one `ops::dot` per (key, head), one
    /// `ops::axpy` per (key, head), keys in order.
    fn naive(kv: &PagedKvCache, table: &[u32], ctx: usize, group: usize, qs: &[f32], scale: f32) -> Vec<f32> {
        let (hd, bs) = (kv.head_dim, kv.block_size);
        let mut buf = vec![0.0f32; bs * hd];
        let mut scores = vec![vec![0.0f32; ctx]; group];
        for p in 0..ctx {
            let keys = kv.k_block(0, table[p / bs] as usize, 1, &mut buf);
            let key = &keys[(p % bs) * hd..(p % bs + 1) * hd];
            for (g, s) in scores.iter_mut().enumerate() {
                s[p] = ops::dot(&qs[g * hd..(g + 1) * hd], key) * scale;
            }
        }
        let mut o = vec![0.0f32; group * hd];
        for s in scores.iter_mut() {
            ops::softmax_inplace(s);
        }
        for p in 0..ctx {
            let vals = kv.v_block(0, table[p / bs] as usize, 1, &mut buf);
            let val = &vals[(p % bs) * hd..(p % bs + 1) * hd];
            for (g, s) in scores.iter().enumerate() {
                ops::axpy(&mut o[g * hd..(g + 1) * hd], s[p], val);
            }
        }
        o
    }

    /// Keys read once for several query heads and values summed in registers give the plain
    /// order's results bit for bit (group tiles with a remainder, head dims with a tail).
    #[test]
    fn decode_attention_keeps_the_plain_summation_order() {
        for (hd, group, ctx) in [(64usize, 3usize, 37usize), (20, 6, 21), (64, 7, 16), (128, 4, 5)] {
            let c = ModelConfig::tiny_attention(2, group, hd);
            for dtype in [KvCacheDtype::Auto, KvCacheDtype::Fp8E4m3] {
                let bs = 8;
                let mut kv = PagedKvCache::new(&c, dtype, bs, 8);
                let table = vec![5u32, 0, 7, 2, 6];
                let f = |i: usize, salt: usize| (((i * 7919 + salt) % 1013) as f32 / 1013.0 - 0.5) * 2.0;
                for pos in 0..ctx {
                    let k: Vec<f32> = (0..2 * hd).map(|i| f(pos * 2 * hd + i, 1)).collect();
                    let v: Vec<f32> = (0..2 * hd).map(|i| f(pos * 2 * hd + i, 2)).collect();
                    kv.write(0, table[pos / bs] as usize, pos % bs, &k, &v);
                }
                let qs: Vec<f32> = (0..group * hd).map(|i| f(i, 3)).collect();
                let scale = 1.0 / (hd as f32).sqrt();
                let task = DecodeAttention {
                    kv: &kv,
                    layer: 0,
                    kvh: 1,
                    table: &table,
                    ctx,
                    group,
                    scale,
                };
                let mut scores = vec![0.0f32; group * 64];
                let mut buf = vec![0.0f32; bs * hd];
                let mut o = vec![f32::NAN; group * hd];
                task.run(&qs, &mut scores, &mut buf, &mut o);
                let want = naive(&kv, &table, ctx, group, &qs, scale);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&o), bits(&want), "hd {hd} group {group} ctx {ctx} {dtype:?}");
                if simd_available() {
                    let mut o2 = vec![f32::NAN; group * hd];
                    // SAFETY: `simd_available` found AVX2 and FMA.
                    unsafe { task.run_avx2(&qs, &mut scores, &mut buf, &mut o2) };
                    assert_eq!(bits(&o2), bits(&want), "avx2 build: hd {hd} group {group} {dtype:?}");
                }
            }
        }
    }
}
