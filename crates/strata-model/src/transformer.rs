//! The forward pass of a llama-family decoder on the CPU backend, over a batch of sequences.
//! Reads and writes the paged KV cache; returns logits only for the positions asked for.

use strata_runtime::cpu::gemm::{gemm_nn, gemm_nt};
use strata_runtime::cpu::ops;
use strata_runtime::cpu::{matmul, matmul_many, DisjointMut, MatmulScratch, ThreadPool};

use crate::batch::{Logits, LogitsWanted, SeqChunk};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::kv_cache::PagedKvCache;
use crate::weights::ModelWeights;

/// Sequences with at least this many new tokens take the GEMM attention path.
const PROMPT_ATTENTION_MIN_TOKENS: usize = 16;

/// A loaded model ready to run.
pub struct Transformer {
    pub config: ModelConfig,
    pub weights: ModelWeights,
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

/// Where each flat token of the batch belongs.
struct TokenSlot {
    seq: usize,
    pos: usize,
}

impl Transformer {
    /// Builds the model from its shape and weights.
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Transformer {
        let inv_freq = config.rope.inv_freq();
        Transformer {
            config,
            weights,
            inv_freq,
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
        let slots: Vec<TokenSlot> = batch
            .iter()
            .enumerate()
            .flat_map(|(seq, ch)| {
                (0..ch.tokens.len()).map(move |i| TokenSlot {
                    seq,
                    pos: ch.first_pos + i,
                })
            })
            .collect();
        let t = slots.len();
        if t == 0 {
            return Ok(Logits {
                rows: vec![],
                vocab: c.vocab_size,
                data: vec![],
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
        for (i, tok) in batch.iter().flat_map(|ch| ch.tokens.iter()).enumerate() {
            w.row_f32(&w.token_embd, *tok as usize, &mut s.x[i * h..(i + 1) * h]);
        }
        // RoPE angles of every token's position, computed once for all layers.
        let half = self.inv_freq.len();
        s.cos.resize(t * half, 0.0);
        s.sin.resize(t * half, 0.0);
        for (i, slot) in slots.iter().enumerate() {
            for (j, &f) in self.inv_freq.iter().enumerate() {
                let angle = slot.pos as f64 * f as f64;
                s.cos[i * half + j] = angle.cos() as f32;
                s.sin[i * half + j] = angle.sin() as f32;
            }
        }

        for (li, lw) in w.layers.iter().enumerate() {
            // Attention block.
            norm_rows(pool, &s.x, &lw.attn_norm, c.rms_eps, h, &mut s.xn);
            let qkv = [w.matrix(&lw.wq), w.matrix(&lw.wk), w.matrix(&lw.wv)];
            matmul_many(pool, &qkv, &s.xn, t, &mut [&mut s.q, &mut s.k, &mut s.v], &mut s.matmul);
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
            self.attention(pool, li, batch, &slots, kv, &s.q, &mut s.attn);
            matmul(pool, &w.matrix(&lw.wo), &s.attn, t, &mut s.proj, &mut s.matmul);
            ops::add_inplace(&mut s.x, &s.proj);

            // Feed-forward block.
            norm_rows(pool, &s.x, &lw.ffn_norm, c.rms_eps, h, &mut s.xn);
            let gate_up = [w.matrix(&lw.w_gate), w.matrix(&lw.w_up)];
            matmul_many(pool, &gate_up, &s.xn, t, &mut [&mut s.gate, &mut s.up], &mut s.matmul);
            ops::silu_mul(&mut s.gate, &s.up);
            matmul(pool, &w.matrix(&lw.w_down), &s.gate, t, &mut s.proj, &mut s.matmul);
            ops::add_inplace(&mut s.x, &s.proj);
        }

        // Logits for the positions asked for.
        let mut rows = Vec::new();
        let mut flat = 0;
        for (si, ch) in batch.iter().enumerate() {
            let n = ch.tokens.len();
            match ch.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => rows.push((si, ch.end_pos() - 1, flat + n - 1)),
                LogitsWanted::All => rows.extend((0..n).map(|i| (si, ch.first_pos + i, flat + i))),
            }
            flat += n;
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
        matmul(pool, &w.matrix(&w.lm_head), &normed, r, &mut data, &mut s.matmul);
        Ok(Logits {
            rows: rows.iter().map(|&(si, p, _)| (si, p)).collect(),
            vocab: c.vocab_size,
            data,
        })
    }

    /// Causal attention of every new token over its sequence's cached context.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        pool: &ThreadPool,
        layer: usize,
        batch: &[SeqChunk],
        slots: &[TokenSlot],
        kv: &PagedKvCache,
        q: &[f32],
        out: &mut [f32],
    ) {
        let c = &self.config;
        let (nh, hd) = (c.n_heads, c.head_dim);
        let group = c.n_heads / c.n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let out = DisjointMut::new(out);
        // Chunks of many tokens (prompts) go through GEMMs per (sequence, head); single tokens
        // (decode) through a dot-product loop per (token, head).
        let mut starts = Vec::with_capacity(batch.len());
        let mut flat = 0;
        for ch in batch {
            starts.push(flat);
            flat += ch.tokens.len();
        }
        let prompt_seqs: Vec<usize> = (0..batch.len())
            .filter(|&s| batch[s].tokens.len() >= PROMPT_ATTENTION_MIN_TOKENS)
            .collect();
        pool.parallel_for(prompt_seqs.len() * nh, 1, &|range| {
            for task in range {
                let (seq, head) = (prompt_seqs[task / nh], task % nh);
                self.prompt_attention(layer, &batch[seq], starts[seq], head, kv, q, &out, scale);
            }
        });
        let decode_tokens: Vec<usize> = (0..slots.len())
            .filter(|&t| batch[slots[t].seq].tokens.len() < PROMPT_ATTENTION_MIN_TOKENS)
            .collect();
        let max_ctx = decode_tokens.iter().map(|&t| slots[t].pos + 1).max().unwrap_or(0);
        let n_kv = c.n_kv_heads;
        // One task per (token, KV head): the `group` query heads that share it read each key
        // and value once.
        let avx2 = simd_available();
        pool.parallel_for(decode_tokens.len() * n_kv, 1, &|range| {
            let mut scores = vec![0.0f32; group * max_ctx];
            for task in range {
                let (ti, kvh) = (decode_tokens[task / n_kv], task % n_kv);
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
                    unsafe { task.run_avx2(qs, &mut scores, o) };
                    continue;
                }
                let _ = avx2;
                task.run(qs, &mut scores, o);
            }
        });
    }

    /// Causal attention of one head for a chunk of prompt tokens: `S = Q K^T`, masked softmax,
    /// `O = P V`, with K and V of the whole context gathered from the paged cache.
    #[allow(clippy::too_many_arguments)]
    fn prompt_attention(
        &self,
        layer: usize,
        chunk: &SeqChunk,
        start: usize,
        head: usize,
        kv: &PagedKvCache,
        q: &[f32],
        out: &DisjointMut<f32>,
        scale: f32,
    ) {
        let c = &self.config;
        let (nh, hd, bs) = (c.n_heads, c.head_dim, kv.block_size);
        let kvh = head / (c.n_heads / c.n_kv_heads);
        let (tq, ctx) = (chunk.tokens.len(), chunk.end_pos());
        let mut keys = vec![0.0f32; ctx * hd];
        let mut vals = vec![0.0f32; ctx * hd];
        for (b, &block) in chunk.block_table[..ctx.div_ceil(bs)].iter().enumerate() {
            let n = bs.min(ctx - b * bs);
            keys[b * bs * hd..(b * bs + n) * hd].copy_from_slice(&kv.k_block(layer, block as usize, kvh)[..n * hd]);
            vals[b * bs * hd..(b * bs + n) * hd].copy_from_slice(&kv.v_block(layer, block as usize, kvh)[..n * hd]);
        }
        let mut scores = vec![0.0f32; tq * ctx];
        let q0 = &q[(start * nh + head) * hd..];
        // SAFETY: `scores` is a local tq x ctx buffer.
        unsafe { gemm_nt(tq, ctx, hd, q0, nh * hd, &keys, hd, scores.as_mut_ptr(), ctx) };
        for (i, row) in scores.chunks_exact_mut(ctx).enumerate() {
            let visible = chunk.first_pos + i + 1;
            row[..visible].iter_mut().for_each(|v| *v *= scale);
            ops::softmax_inplace(&mut row[..visible]);
            row[visible..].fill(0.0);
        }
        // SAFETY: this task alone writes head `head` of tokens start..start+tq (stride nh*hd).
        unsafe {
            gemm_nn(
                tq,
                hd,
                ctx,
                &scores,
                ctx,
                &vals,
                hd,
                out.as_mut_ptr().add((start * nh + head) * hd),
                nh * hd,
            )
        };
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
    /// `o` (group x head_dim) = softmax(q K^T * scale) V; `scores` holds group x ctx values.
    #[inline(always)]
    fn run(&self, qs: &[f32], scores: &mut [f32], o: &mut [f32]) {
        let (hd, bs, ctx, group) = (self.kv.head_dim, self.kv.block_size, self.ctx, self.group);
        let stride = scores.len() / group;
        let blocks = &self.table[..ctx.div_ceil(bs)];
        for (b, &block) in blocks.iter().enumerate() {
            let keys = self.kv.k_block(self.layer, block as usize, self.kvh);
            for j in 0..bs.min(ctx - b * bs) {
                let key = &keys[j * hd..(j + 1) * hd];
                for g in 0..group {
                    scores[g * stride + b * bs + j] = ops::dot(&qs[g * hd..(g + 1) * hd], key) * self.scale;
                }
            }
        }
        o.fill(0.0);
        for g in 0..group {
            ops::softmax_inplace(&mut scores[g * stride..g * stride + ctx]);
        }
        for (b, &block) in blocks.iter().enumerate() {
            let vals = self.kv.v_block(self.layer, block as usize, self.kvh);
            for j in 0..bs.min(ctx - b * bs) {
                let val = &vals[j * hd..(j + 1) * hd];
                for g in 0..group {
                    ops::axpy(&mut o[g * hd..(g + 1) * hd], scores[g * stride + b * bs + j], val);
                }
            }
        }
    }

    /// [`Self::run`] compiled for AVX2 and FMA (the loops are small and hot in decode).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, qs: &[f32], scores: &mut [f32], o: &mut [f32]) {
        self.run(qs, scores, o)
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
