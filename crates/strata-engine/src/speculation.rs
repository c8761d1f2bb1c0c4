//! Speculative decoding's settings (prompt lookup and draft model), n-gram proposals from a
//! sequence's own prompt and output, the rule that turns speculation off in large batches, and the acceptance counts.

/// Speculation by prompt lookup (`--speculative-ngram MAX:MIN:TOKENS`, vLLM's
/// `prompt_lookup_max`, `prompt_lookup_min` and `num_speculative_tokens`): the last n tokens of a
/// sequence (n from `lookup_max` down to `lookup_min`) are looked up earlier in its prompt and
/// output, and the tokens that followed the latest match are the draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramSpeculation {
    /// Longest n-gram looked up.
    pub lookup_max: usize,
    /// Shortest n-gram looked up.
    pub lookup_min: usize,
    /// Draft tokens proposed per step, at most.
    pub num_tokens: usize,
    /// Speculation is off in a step when more sequences than this run or wait
    /// (`--speculative-disable-by-batch-size`).
    pub disable_by_batch_size: usize,
}

/// Sequences (running and waiting) above which speculation is off, measured on the CPU with the
/// speculation bench and the row-group kernels (bench/NOTES.md, issue 32): with the rule off,
/// drafting gave 1.40x the aggregate tok/s at 2 users, 1.10x at 3, 1.01-1.06x at 4, and cost
/// 5-10 % from 6 users on.
pub const DEFAULT_DISABLE_BY_BATCH_SIZE: usize = 4;

impl NgramSpeculation {
    /// `TOKENS` (n-grams of 1 to 3 tokens) or `MAX:MIN:TOKENS`, e.g. `3:1:4`.
    pub fn parse(s: &str) -> Result<NgramSpeculation, String> {
        let numbers: Vec<usize> = s
            .split(':')
            .map(|p| p.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .map_err(|_| format!("--speculative-ngram takes TOKENS or MAX:MIN:TOKENS (e.g. 3:1:4), got {s:?}"))?;
        let (lookup_max, lookup_min, num_tokens) = match numbers[..] {
            [tokens] => (3, 1, tokens),
            [max, min, tokens] => (max, min, tokens),
            _ => {
                return Err(format!(
                    "--speculative-ngram takes TOKENS or MAX:MIN:TOKENS (e.g. 3:1:4), got {s:?}"
                ))
            }
        };
        let spec = NgramSpeculation {
            lookup_max,
            lookup_min,
            num_tokens,
            disable_by_batch_size: DEFAULT_DISABLE_BY_BATCH_SIZE,
        };
        spec.validate()?;
        Ok(spec)
    }

    /// Checks the sizes; the message names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.lookup_min == 0 || self.lookup_min > self.lookup_max {
            return Err(format!(
                "--speculative-ngram: n-gram sizes must satisfy 1 <= MIN <= MAX, got MAX {} MIN {}",
                self.lookup_max, self.lookup_min
            ));
        }
        check_num_tokens(self.num_tokens, "--speculative-ngram: draft tokens")
    }

    /// Whether sequences draft in a step where `active` sequences run or wait.
    pub fn on_at(&self, active: usize) -> bool {
        speculates_at(active, self.disable_by_batch_size)
    }

    /// Up to `max` draft tokens for the sequence whose tokens so far are `context`: the tokens
    /// after the latest earlier occurrence of its last n tokens, the longest n that matches
    /// first. Empty when nothing matches.
    pub fn propose(&self, context: &[u32], max: usize) -> Vec<u32> {
        let max = max.min(self.num_tokens);
        if max == 0 {
            return Vec::new();
        }
        let len = context.len();
        for n in (self.lookup_min..=self.lookup_max).rev() {
            if len <= n {
                continue;
            }
            let suffix = &context[len - n..];
            // Latest start before the suffix itself whose n tokens equal it.
            let found = (0..len - n).rev().find(|&j| &context[j..j + n] == suffix);
            if let Some(j) = found {
                let from = j + n;
                return context[from..(from + max).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

/// Most draft tokens a step may verify per sequence.
pub const MAX_DRAFT_TOKENS: usize = 16;

/// Draft tokens a step proposes with a draft model unless `--num-speculative-tokens` says otherwise.
pub const DEFAULT_DRAFT_MODEL_TOKENS: usize = 4;

/// Checks a draft length; `what` names the flag that set it.
fn check_num_tokens(num_tokens: usize, what: &str) -> Result<(), String> {
    if !(1..=MAX_DRAFT_TOKENS).contains(&num_tokens) {
        return Err(format!("{what} must be in 1..={MAX_DRAFT_TOKENS}, got {num_tokens}"));
    }
    Ok(())
}

/// The one rule of both methods: sequences draft while at most `disable_by_batch_size` run or wait.
fn speculates_at(active: usize, disable_by_batch_size: usize) -> bool {
    active <= disable_by_batch_size
}

/// Speculation with a draft model (`--speculative-model PATH --num-speculative-tokens N`, vLLM's
/// `model` and `num_speculative_tokens`): a smaller model with the target's tokenizer proposes
/// each sequence's next tokens greedily; the model itself goes to the engine beside the target's
/// executor ([`crate::DraftModel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftModelSpeculation {
    /// Draft tokens proposed per step, at most.
    pub num_tokens: usize,
    /// Speculation is off in a step when more sequences than this run or wait
    /// (`--speculative-disable-by-batch-size`).
    pub disable_by_batch_size: usize,
}

impl DraftModelSpeculation {
    /// `num_tokens` draft tokens a step, with the default batch-size rule.
    pub fn new(num_tokens: usize) -> DraftModelSpeculation {
        DraftModelSpeculation {
            num_tokens,
            disable_by_batch_size: DEFAULT_DISABLE_BY_BATCH_SIZE,
        }
    }

    /// Checks the draft length; the message names the flag.
    pub fn validate(&self) -> Result<(), String> {
        check_num_tokens(self.num_tokens, "--num-speculative-tokens")
    }

    /// Whether sequences draft in a step where `active` sequences run or wait.
    pub fn on_at(&self, active: usize) -> bool {
        speculates_at(active, self.disable_by_batch_size)
    }
}

/// Draft tokens proposed and accepted, by position in the draft (index 0 = the first draft token).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftCounts {
    pub proposed: Vec<u64>,
    pub accepted: Vec<u64>,
}

impl DraftCounts {
    /// One verification: `proposed` draft tokens, the first `accepted` of them taken.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if self.proposed.len() < proposed {
            self.proposed.resize(proposed, 0);
            self.accepted.resize(proposed, 0);
        }
        self.proposed[..proposed].iter_mut().for_each(|n| *n += 1);
        self.accepted[..accepted].iter_mut().for_each(|n| *n += 1);
    }

    /// Draft tokens proposed in all.
    pub fn proposed_total(&self) -> u64 {
        self.proposed.iter().sum()
    }

    /// Draft tokens accepted in all.
    pub fn accepted_total(&self) -> u64 {
        self.accepted.iter().sum()
    }

    /// Accepted over proposed (0 before any draft).
    pub fn acceptance_rate(&self) -> f64 {
        let proposed = self.proposed_total();
        if proposed == 0 {
            0.0
        } else {
            self.accepted_total() as f64 / proposed as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(max: usize, min: usize, tokens: usize) -> NgramSpeculation {
        NgramSpeculation {
            lookup_max: max,
            lookup_min: min,
            num_tokens: tokens,
            disable_by_batch_size: 8,
        }
    }

    #[test]
    fn proposals_follow_the_latest_match_of_the_longest_ngram() {
        let s = spec(3, 1, 4);
        // The last 3 tokens (1 2 3) occurred at 0 and 5; the latest one is followed by 9 8.
        let ctx = [1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 1, 2, 3];
        assert_eq!(s.propose(&ctx, 4), [9, 8, 1, 2]);
        assert_eq!(s.propose(&ctx, 2), [9, 8]);
        assert_eq!(s.propose(&ctx, 0), Vec::<u32>::new());
        // No 3- or 2-gram match: the 1-gram (7) matches at 1.
        assert_eq!(s.propose(&[5, 7, 6, 4, 7], 4), [6, 4, 7]);
        // Shortest n-gram 2: a lone repeated token is no match.
        assert_eq!(spec(3, 2, 4).propose(&[5, 7, 6, 4, 7], 4), Vec::<u32>::new());
        assert_eq!(s.propose(&[1], 4), Vec::<u32>::new());
        // A run repeats itself: the draft overlaps the suffix.
        assert_eq!(s.propose(&[4, 4, 4, 4], 3), [4]);
    }

    #[test]
    fn parse_takes_tokens_or_max_min_tokens() {
        assert_eq!(
            NgramSpeculation::parse("4").unwrap(),
            spec(3, 1, 4).with_default_threshold()
        );
        assert_eq!(
            NgramSpeculation::parse("5:2:6").unwrap(),
            spec(5, 2, 6).with_default_threshold()
        );
        for bad in ["", "0", "1:2:4", "3:0:4", "3:1", "a", "3:1:99"] {
            assert!(NgramSpeculation::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    impl NgramSpeculation {
        fn with_default_threshold(self) -> NgramSpeculation {
            NgramSpeculation {
                disable_by_batch_size: DEFAULT_DISABLE_BY_BATCH_SIZE,
                ..self
            }
        }
    }

    /// Verifying a draft token by drawing the target's token and keeping the draft when they
    /// match is rejection sampling of a one-token proposal: over many seeds the draft is kept
    /// with the target's probability of it, and the tokens drawn instead follow the target's
    /// distribution without it (chi-square over the histogram).
    #[test]
    fn verification_keeps_a_draft_with_the_target_probability_and_draws_the_rest_from_the_residual() {
        use crate::sampler::{Sampler, SamplingParams};
        let row = [1.0f32, 2.5, 0.3, 2.0, -1.0, 1.7];
        let params = SamplingParams {
            temperature: 0.8,
            ..Default::default()
        };
        let weights: Vec<f64> = row.iter().map(|&l| ((l / 0.8) as f64).exp()).collect();
        let total: f64 = weights.iter().sum();
        let p: Vec<f64> = weights.iter().map(|w| w / total).collect();
        let draft = 3u32;
        let draws = 40_000;
        let mut kept = 0usize;
        let mut rejected = [0usize; 6];
        for seed in 0..draws as u64 {
            let token = Sampler::new(SamplingParams { seed, ..params.clone() }).sample(&row, &[], &[], None);
            if token == draft {
                kept += 1;
            } else {
                rejected[token as usize] += 1;
            }
        }
        let pd = p[draft as usize];
        let sigma = (pd * (1.0 - pd) / draws as f64).sqrt();
        assert!(
            ((kept as f64 / draws as f64) - pd).abs() < 5.0 * sigma,
            "kept {kept} of {draws}, p {pd}"
        );
        let n_rejected = (draws - kept) as f64;
        let chi2: f64 = (0..6)
            .filter(|&t| t != draft as usize)
            .map(|t| {
                let expected = n_rejected * p[t] / (1.0 - pd);
                (rejected[t] as f64 - expected).powi(2) / expected
            })
            .sum();
        // 4 degrees of freedom: P(chi2 > 18.5) < 0.001.
        assert!(chi2 < 18.5, "residual histogram {rejected:?}, chi2 {chi2}");
    }

    #[test]
    fn counts_by_position() {
        let mut c = DraftCounts::default();
        c.record(3, 1);
        c.record(2, 2);
        c.record(0, 0);
        assert_eq!(c.proposed, [2, 2, 1]);
        assert_eq!(c.accepted, [2, 1, 0]);
        assert_eq!(c.proposed_total(), 5);
        assert_eq!(c.accepted_total(), 3);
        assert!((c.acceptance_rate() - 0.6).abs() < 1e-12);
    }
}
