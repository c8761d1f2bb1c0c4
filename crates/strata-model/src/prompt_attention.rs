//! Causal attention of prompt tokens on the CPU: a run of consecutive prompt tokens of one
//! sequence and the query heads of one KV head, as two packed GEMMs over the paged cache.

use strata_runtime::cpu::gemm::{gemm_packed, pack_panels, packed_len};
use strata_runtime::cpu::ops;

use crate::kv_cache::PagedKvCache;

/// Prompt tokens per tile: with 3 query heads per KV head, 48 query rows (three panels).
pub(crate) const TILE_TOKENS: usize = 16;

/// Attention of `tokens` consecutive prompt tokens from position `first_pos`, for the `group`
/// query heads sharing KV head `kvh`.
///
/// Every value is computed the same way whatever tile the token is in: a score is one FMA
/// chain over the head dimension, a softmax runs over the token's own context, and an output
/// is one FMA chain over the tile's context where the keys past the token's own context
/// weigh exactly 0 (adding `0 * v` leaves a chain unchanged). So a token's result does not
/// depend on how the prompt was chunked or tiled, nor on the other sequences of the batch.
pub(crate) struct PromptTile<'a> {
    pub kv: &'a PagedKvCache,
    pub layer: usize,
    pub kvh: usize,
    pub table: &'a [u32],
    pub first_pos: usize,
    pub tokens: usize,
    pub group: usize,
    pub scale: f32,
}

thread_local! {
    /// Each thread's buffers for [`PromptTile::run`], kept across calls (buffers this large
    /// come from fresh pages when allocated per call).
    pub(crate) static TILE_SCRATCH: std::cell::RefCell<TileScratch> = std::cell::RefCell::new(TileScratch::default());
}

/// Buffers of [`PromptTile::run`], reused across tiles by one thread.
#[derive(Default)]
pub(crate) struct TileScratch {
    rows: Vec<f32>,
    panels: Vec<f32>,
    keys: Vec<f32>,
    scores: Vec<f32>,
    probs: Vec<f32>,
    out: Vec<f32>,
    block: Vec<f32>,
}

impl PromptTile<'_> {
    /// `q(t, g)` is the query of head `g` of the tile's token `t` (`head_dim` values); the
    /// output of that head is written through `out(t, g)`.
    pub fn run<'q>(
        &self,
        q: impl Fn(usize, usize) -> &'q [f32],
        mut out: impl FnMut(usize, usize, &[f32]),
        s: &mut TileScratch,
    ) {
        let (hd, bs) = (self.kv.head_dim, self.kv.block_size);
        let rows = self.tokens * self.group;
        let ctx = self.first_pos + self.tokens;
        // Queries, one row per (token, head), packed as the panels of the score GEMM.
        s.rows.resize(rows * hd, 0.0);
        for t in 0..self.tokens {
            for g in 0..self.group {
                let r = t * self.group + g;
                s.rows[r * hd..(r + 1) * hd].copy_from_slice(q(t, g));
            }
        }
        s.panels.resize(packed_len(rows, hd).max(packed_len(hd, ctx)), 0.0);
        pack_panels(&s.rows, rows, hd, hd, 1, &mut s.panels);
        // Keys of the whole context, contiguous.
        s.keys.resize(ctx * hd, 0.0);
        s.block.resize(bs * hd, 0.0);
        for (b, &block) in self.table[..ctx.div_ceil(bs)].iter().enumerate() {
            let n = bs.min(ctx - b * bs) * hd;
            let keys = self.kv.k_block(self.layer, block as usize, self.kvh, &mut s.block);
            s.keys[b * bs * hd..b * bs * hd + n].copy_from_slice(&keys[..n]);
        }
        // scores[j][r] = key j . query r
        s.scores.resize(ctx * rows, 0.0);
        // SAFETY: scores holds ctx x rows values.
        unsafe { gemm_packed(ctx, rows, hd, &s.keys, hd, &s.panels, s.scores.as_mut_ptr(), rows) };
        // Each query row's softmax over its own context; weight 0 past it.
        s.probs.resize(rows * ctx, 0.0);
        for r in 0..rows {
            let own = self.first_pos + r / self.group + 1;
            let p = &mut s.probs[r * ctx..(r + 1) * ctx];
            for (j, v) in p[..own].iter_mut().enumerate() {
                *v = s.scores[j * rows + r] * self.scale;
            }
            ops::softmax_inplace(&mut p[..own]);
            p[own..].fill(0.0);
        }
        // Values of the whole context, packed as the panels of the output GEMM (head_dim
        // columns of depth ctx): the value rows are that matrix transposed.
        for (b, &block) in self.table[..ctx.div_ceil(bs)].iter().enumerate() {
            let n = bs.min(ctx - b * bs) * hd;
            let vals = self.kv.v_block(self.layer, block as usize, self.kvh, &mut s.block);
            s.keys[b * bs * hd..b * bs * hd + n].copy_from_slice(&vals[..n]);
        }
        pack_panels(&s.keys, hd, ctx, 1, hd, &mut s.panels);
        s.out.resize(rows * hd, 0.0);
        // SAFETY: out holds rows x head_dim values.
        unsafe { gemm_packed(rows, hd, ctx, &s.probs, ctx, &s.panels, s.out.as_mut_ptr(), hd) };
        for t in 0..self.tokens {
            for g in 0..self.group {
                let r = t * self.group + g;
                out(t, g, &s.out[r * hd..(r + 1) * hd]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::kv_cache::KvCacheDtype;

    /// 21 positions of one sequence over shuffled blocks of 4, 2 KV heads of dim 20, 3 query
    /// heads per KV head.
    fn setup() -> (PagedKvCache, Vec<u32>, Vec<f32>) {
        let c = ModelConfig::tiny_attention(2, 3, 20);
        let mut kv = PagedKvCache::new(&c, KvCacheDtype::Auto, 4, 8);
        let table = vec![5u32, 0, 7, 2, 6, 1];
        let f = |i: usize, salt: usize| (((i * 7919 + salt) % 1013) as f32 / 1013.0 - 0.5) * 2.0;
        for pos in 0..21 {
            let k: Vec<f32> = (0..40).map(|i| f(pos * 40 + i, 1)).collect();
            let v: Vec<f32> = (0..40).map(|i| f(pos * 40 + i, 2)).collect();
            kv.write(0, table[pos / 4] as usize, pos % 4, &k, &v);
        }
        let q: Vec<f32> = (0..21 * 120).map(|i| f(i, 3)).collect();
        (kv, table, q)
    }

    /// Runs positions `first..first + tokens` as one tile; returns each (position, KV head,
    /// head)'s output.
    fn tile(kv: &PagedKvCache, table: &[u32], q: &[f32], first: usize, tokens: usize, kvh: usize) -> Vec<f32> {
        let t = PromptTile {
            kv,
            layer: 0,
            kvh,
            table,
            first_pos: first,
            tokens,
            group: 3,
            scale: 0.3,
        };
        let mut out = vec![0.0; tokens * 60];
        let head = |t: usize, g: usize| ((first + t) * 6 + kvh * 3 + g) * 20;
        t.run(
            |t, g| &q[head(t, g)..head(t, g) + 20],
            |t, g, o| out[(t * 3 + g) * 20..(t * 3 + g + 1) * 20].copy_from_slice(o),
            &mut TileScratch::default(),
        );
        out
    }

    #[test]
    fn a_tile_matches_naive_causal_attention() {
        let (kv, table, q) = setup();
        for kvh in 0..2 {
            let got = tile(&kv, &table, &q, 0, 21, kvh);
            let mut buf = vec![0.0; 80];
            // The test cache is f32: rows come straight from it.
            let mut key = |j: usize| kv.k_block(0, table[j / 4] as usize, kvh, &mut buf)[(j % 4) * 20..][..20].to_vec();
            let keys: Vec<Vec<f32>> = (0..21).map(&mut key).collect();
            let mut val = |j: usize| kv.v_block(0, table[j / 4] as usize, kvh, &mut buf)[(j % 4) * 20..][..20].to_vec();
            let vals: Vec<Vec<f32>> = (0..21).map(&mut val).collect();
            for pos in 0..21 {
                for g in 0..3 {
                    let qh = &q[(pos * 6 + kvh * 3 + g) * 20..][..20];
                    let s: Vec<f64> = (0..=pos)
                        .map(|j| keys[j].iter().zip(qh).map(|(a, b)| (a * b) as f64).sum::<f64>() * 0.3)
                        .collect();
                    let max = s.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for d in 0..20 {
                        let want: f64 = (0..=pos).map(|j| e[j] / sum * vals[j][d] as f64).sum();
                        let have = got[(pos * 3 + g) * 20 + d] as f64;
                        assert!(
                            (have - want).abs() < 1e-5,
                            "pos {pos} head {g} dim {d}: {have} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// A token's output is the same bits whatever tile it is computed in.
    #[test]
    fn a_token_does_not_depend_on_its_tile() {
        let (kv, table, q) = setup();
        for kvh in 0..2 {
            let whole = tile(&kv, &table, &q, 0, 21, kvh);
            for (first, tokens) in [(0, 1), (3, 5), (7, 14), (16, 16 - 11), (20, 1)] {
                let part = tile(&kv, &table, &q, first, tokens, kvh);
                assert_eq!(
                    part[..],
                    whole[first * 60..(first + tokens) * 60],
                    "tile {first}+{tokens}"
                );
            }
        }
    }
}
