//! The calls of sampling.cu that choose each logits row's token (`sampling_limits`,
//! `argmax_slices`, `argmax_merge`) and that feed chosen ids back as inputs (`tokens_from_argmax`).

use std::ffi::c_void;

use crate::kernel_args;

/// Blocks a row's argmax is split over (sampling.cu's ARGMAX_SLICES).
pub const ARGMAX_SLICES: usize = 32;
/// Words of a logits row's sampling parameters (sampling.cu's SAMPLING_WORDS): 1 / temperature
/// (f32 bits, 0 for the plain argmax), the seed's low and high words, top_k, top_p, min_p.
pub const SAMPLING_WORDS: usize = 6;
/// Threads of `sampling_limits` (sampling.cu's LIMIT_THREADS).
pub const LIMIT_THREADS: u32 = 512;
/// Threads of an `argmax_slices` block and of an `argmax_merge` block (a warp a row).
const SLICE_THREADS: u32 = 256;
const MERGE_THREADS: u32 = 32;
/// Threads of a `tokens_from_argmax` block (a thread a token).
const FEED_THREADS: u32 = 128;

/// The device pointers and sizes of choosing the token of `rows` f32 logits rows: the limits of
/// the sampled rows' top-k / top-p / min-p, then each row's argmax (of its logits, or for sampled
/// rows of logit / temperature plus a Gumbel variate, over the tokens within its limit).
#[derive(Debug, Clone, Copy)]
pub struct ChooseTokensCall {
    /// `[rows, vocab]` f32 logits, this GPU's vocabulary slice.
    pub logits: u64,
    pub vocab: i32,
    /// `[rows, SAMPLING_WORDS]` u32 parameters, or 0: every row takes its plain argmax (and
    /// `sampling_limits` is not launched).
    pub sampling: u64,
    /// `[rows, 2]` u32: each row's best logit (f32 bits) and largest key kept.
    pub limits: u64,
    /// f32 and i32 `[rows, ARGMAX_SLICES]`: each slice's best.
    pub part_vals: u64,
    pub part_ids: u64,
    /// `[rows]` u32 chosen ids (0 when every logit is NaN) and f32 their (perturbed) logits.
    pub ids: u64,
    pub vals: u64,
    /// The first id of this GPU's slice (the Gumbel variates are the whole vocabulary's).
    pub vocab_start: i32,
    pub rows: usize,
}

impl ChooseTokensCall {
    /// `sampling_limits`: a block a row.
    fn limits_shape(&self) -> ((u32, u32, u32), u32) {
        ((self.rows as u32, 1, 1), LIMIT_THREADS)
    }

    fn limits_args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.logits, self.vocab, self.sampling, self.limits).to_vec()
    }

    /// `argmax_slices`: grid (rows, ARGMAX_SLICES).
    fn slices_shape(&self) -> ((u32, u32, u32), u32) {
        ((self.rows as u32, ARGMAX_SLICES as u32, 1), SLICE_THREADS)
    }

    fn slices_args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.logits,
            self.vocab,
            self.part_vals,
            self.part_ids,
            self.sampling,
            self.limits,
            self.vocab_start
        )
        .to_vec()
    }

    /// `argmax_merge`: a warp a row.
    fn merge_shape(&self) -> ((u32, u32, u32), u32) {
        ((self.rows as u32, 1, 1), MERGE_THREADS)
    }

    fn merge_args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.part_vals, self.part_ids, self.ids, self.vals).to_vec()
    }

    /// Launches `sampling_limits` (when `sampling` is given), `argmax_slices` and
    /// `argmax_merge`, each through `launch(name, grid, threads a block, dynamic shared bytes,
    /// arguments)` (the forward pass's launcher profiles and ablates); no rows launch nothing.
    pub fn launch_with<E>(
        &self,
        mut launch: impl FnMut(&str, (u32, u32, u32), u32, u32, &mut [*mut c_void]) -> Result<(), E>,
    ) -> Result<(), E> {
        if self.rows == 0 {
            return Ok(());
        }
        if self.sampling != 0 {
            let (grid, threads) = self.limits_shape();
            launch("sampling_limits", grid, threads, 0, &mut self.limits_args())?;
        }
        let (grid, threads) = self.slices_shape();
        launch("argmax_slices", grid, threads, 0, &mut self.slices_args())?;
        let (grid, threads) = self.merge_shape();
        launch("argmax_merge", grid, threads, 0, &mut self.merge_args())
    }

    stream_launch!("sampling.cu");
}

/// `tokens[i] = ids[tokens[i]]` for i < n (`tokens_from_argmax`): an overlapped decode step's
/// input tokens taken from the step before's chosen ids on the device.
#[derive(Debug, Clone, Copy)]
pub struct TokensFromArgmaxCall {
    /// `[n]` i32: each token's row in the step before, replaced by its chosen id.
    pub tokens: u64,
    /// u32 ids as `argmax_merge` wrote them.
    pub ids: u64,
    pub n: i32,
}

impl TokensFromArgmaxCall {
    pub fn name(&self) -> &'static str {
        "tokens_from_argmax"
    }

    /// A thread a token.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        (((self.n.max(0) as u32).div_ceil(FEED_THREADS), 1, 1), FEED_THREADS, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.tokens, self.ids, self.n).to_vec()
    }

    one_kernel_launch!("sampling.cu");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::arg_at as at;

    fn call(sampling: u64) -> ChooseTokensCall {
        ChooseTokensCall {
            logits: 1,
            vocab: 2,
            sampling,
            limits: 4,
            part_vals: 5,
            part_ids: 6,
            ids: 7,
            vals: 8,
            vocab_start: 9,
            rows: 10,
        }
    }

    #[test]
    fn the_arguments_come_in_sampling_cu_order() {
        let c = call(3);
        assert_eq!(
            c.limits_args(),
            vec![at(&c.logits), at(&c.vocab), at(&c.sampling), at(&c.limits)]
        );
        assert_eq!(
            c.slices_args(),
            vec![
                at(&c.logits),
                at(&c.vocab),
                at(&c.part_vals),
                at(&c.part_ids),
                at(&c.sampling),
                at(&c.limits),
                at(&c.vocab_start)
            ]
        );
        assert_eq!(
            c.merge_args(),
            vec![at(&c.part_vals), at(&c.part_ids), at(&c.ids), at(&c.vals)]
        );
        let t = TokensFromArgmaxCall {
            tokens: 1,
            ids: 2,
            n: 300,
        };
        assert_eq!(t.args(), vec![at(&t.tokens), at(&t.ids), at(&t.n)]);
        assert_eq!((t.name(), t.shape()), ("tokens_from_argmax", ((3, 1, 1), 128, 0)));
    }

    /// One launch: (kernel, grid, threads, shared bytes, arguments).
    type Launch = (String, (u32, u32, u32), u32, u32, usize);

    /// The launches a call makes.
    fn launches(c: &ChooseTokensCall) -> Vec<Launch> {
        let mut seen = Vec::new();
        c.launch_with(|name, grid, threads, shared, args| {
            seen.push((name.to_string(), grid, threads, shared, args.len()));
            Ok::<(), ()>(())
        })
        .unwrap();
        seen
    }

    #[test]
    fn sampled_rows_get_their_limits_first_and_plain_rows_do_not() {
        let merge = ("argmax_merge".to_string(), (10, 1, 1), 32, 0, 4);
        let slices = ("argmax_slices".to_string(), (10, 32, 1), 256, 0, 7);
        let limits = ("sampling_limits".to_string(), (10, 1, 1), 512, 0, 4);
        assert_eq!(launches(&call(3)), vec![limits, slices.clone(), merge.clone()]);
        assert_eq!(launches(&call(0)), vec![slices, merge]);
        assert!(launches(&ChooseTokensCall { rows: 0, ..call(3) }).is_empty());
    }
}
