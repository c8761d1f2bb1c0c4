//! Choosing the next token from logits: penalties, then greedy or temperature with top-k /
//! top-p / min-p and a seed. Each sequence owns its random stream, so its output does not depend on what else runs.

use crate::request::TokenLogprob;
use strata_model::DeviceSampling;
use toktrie::SimpleVob;

/// Smallest temperature other than 0 (greedy): below it the logits scaled by 1 / temperature
/// overflow to infinity. Clients' smaller values are read as greedy, as vLLM does.
pub const MIN_TEMPERATURE: f32 = 1e-5;
/// Largest temperature: far above it every distribution is already uniform.
pub const MAX_TEMPERATURE: f32 = 100.0;
/// Repetition penalties allowed (vLLM asks only > 0; beyond this range a penalty turns the
/// logits of every seen token into noise or overflows them).
pub const REPETITION_PENALTY_RANGE: (f32, f32) = (0.01, 10.0);
/// Most `logit_bias` entries a request may carry (OpenAI documents no limit; each costs an add
/// per sampled token).
pub const MAX_LOGIT_BIAS: usize = strata_model::MAX_ROW_BIAS;

/// How to pick tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no limit.
    pub top_k: usize,
    /// 1.0 means no limit.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top one's (0 = off).
    pub min_p: f32,
    /// Divides positive / multiplies negative logits of tokens seen in prompt or output (1 = off).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated (OpenAI semantics).
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every token already generated.
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids before anything else (OpenAI's `logit_bias`,
    /// each in [-100, 100]).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks ranges; the message names the parameter.
    pub fn validate(&self) -> Result<(), String> {
        let t = self.temperature;
        if !(t == 0.0 || (MIN_TEMPERATURE..=MAX_TEMPERATURE).contains(&t)) {
            return Err(format!(
                "temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t}"
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        let (low, high) = REPETITION_PENALTY_RANGE;
        if !(low..=high).contains(&self.repetition_penalty) {
            return Err(format!(
                "repetition_penalty must be in [{low}, {high}] (1 = off), got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(format!(
                "logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {}",
                self.logit_bias.len()
            ));
        }
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(format!("logit_bias of token {t} must be in [-100, 100], got {b}"));
        }
        Ok(())
    }

    /// Greedy with nothing that needs the whole row: the argmax alone decides the token.
    /// (The logit bias is the engine's to check: an executor that samples on its device applies it.)
    pub fn is_plain_greedy(&self) -> bool {
        (self.temperature == 0.0 || self.top_k == 1) && !self.has_penalties()
    }

    /// What an executor that samples on its device draws for these parameters (its `seed` still
    /// 0): temperature with top-k / top-p / min-p, nothing else (no penalties).
    pub fn on_device(&self) -> Option<DeviceSampling> {
        (self.temperature > 0.0 && !self.has_penalties()).then(|| DeviceSampling {
            temperature: self.temperature,
            top_k: u32::try_from(self.top_k).unwrap_or(u32::MAX),
            top_p: self.top_p,
            min_p: self.min_p,
            seed: 0,
        })
    }

    fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// A sampler with its own random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = SplitMix64(params.seed ^ 0x9E37_79B9_7F4A_7C15);
        Sampler { params, rng }
    }

    /// The next draw of this sequence's random stream, as the seed of a token sampled on the
    /// device; the stream stays the sequence's own.
    pub fn next_seed(&mut self) -> u64 {
        self.rng.next_u64()
    }

    /// The next token for these logits, given the prompt and the tokens generated so far
    /// (for the penalties) and, for a constrained sequence, the tokens its grammar allows.
    /// Logit bias and the penalties apply first, then the mask, then the choice.
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], generated: &[u32], allowed: Option<&SimpleVob>) -> u32 {
        let adjusted;
        let logits = if self.params.has_penalties() || !self.params.logit_bias.is_empty() || allowed.is_some() {
            adjusted = self.adjust(logits, prompt, generated, allowed);
            &adjusted[..]
        } else {
            logits
        };
        if self.params.temperature == 0.0 || self.params.top_k == 1 {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.params.temperature;
        if self.params.top_k == 0 && self.params.top_p >= 1.0 && self.params.min_p <= 0.0 {
            return self.sample_whole(logits, inv_t);
        }
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l * inv_t)).collect();
        // Highest first; ties broken by the lower id so the order is deterministic. With top_k
        // only the k best are sorted (a full sort of a 150k vocabulary costs ~10 ms a token).
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.params.top_k > 0 && self.params.top_k < cand.len() {
            cand.select_nth_unstable_by(self.params.top_k - 1, order);
            cand.truncate(self.params.top_k);
        }
        cand.sort_unstable_by(order);
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
        if self.params.min_p > 0.0 {
            // probs[0] is the top token's relative weight (1.0); keep those above min_p of it.
            let keep = probs
                .iter()
                .position(|&p| p < self.params.min_p)
                .unwrap_or(probs.len())
                .max(1);
            probs.truncate(keep);
        }
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|&p| {
                    acc += p;
                    acc >= self.params.top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            let s: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= s);
        }
        let r = self.rng.next_f32();
        let mut acc = 0.0;
        for (i, &p) in probs.iter().enumerate() {
            acc += p;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[probs.len() - 1].0
    }

    /// Temperature sampling from the whole distribution: one pass in id order, no sort.
    fn sample_whole(&mut self, logits: &[f32], inv_t: f32) -> u32 {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l)) * inv_t;
        let sum: f32 = logits.iter().map(|&l| (l * inv_t - max).exp()).sum();
        let target = self.rng.next_f32() * sum;
        let mut acc = 0.0;
        let mut last = 0;
        for (i, &l) in logits.iter().enumerate() {
            let p = (l * inv_t - max).exp();
            if p > 0.0 {
                last = i;
            }
            acc += p;
            if target < acc {
                return i as u32;
            }
        }
        last as u32
    }
}

impl Sampler {
    /// Logits with repetition, presence and frequency penalties and the logit bias applied, and
    /// every token outside `allowed` (ids past the tokenizer's vocabulary included) at -inf.
    fn adjust(&self, logits: &[f32], prompt: &[u32], generated: &[u32], allowed: Option<&SimpleVob>) -> Vec<f32> {
        let p = &self.params;
        let mut out = logits.to_vec();
        for &(t, bias) in &p.logit_bias {
            if let Some(l) = out.get_mut(t as usize) {
                *l += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            let mut seen: Vec<u32> = prompt
                .iter()
                .chain(generated)
                .copied()
                .filter(|&t| (t as usize) < out.len())
                .collect();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                let l = &mut out[t as usize];
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts: Vec<(u32, u32)> = Vec::new();
            let mut sorted: Vec<u32> = generated
                .iter()
                .copied()
                .filter(|&t| (t as usize) < out.len())
                .collect();
            sorted.sort_unstable();
            for t in sorted {
                match counts.last_mut() {
                    Some((last, c)) if *last == t => *c += 1,
                    _ => counts.push((t, 1)),
                }
            }
            for (t, c) in counts {
                out[t as usize] -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
        if let Some(allowed) = allowed {
            for (t, l) in out.iter_mut().enumerate() {
                if t >= allowed.len() || !allowed.is_allowed(t as u32) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        out
    }
}

/// Log-probability of `token` under the model's raw distribution (before penalties and
/// temperature, as vLLM reports it), and the `top` most likely tokens with theirs.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |t: u32| (logits[t as usize] as f64 - log_z) as f32;
    let mut best: Vec<u32> = Vec::with_capacity(top + 1);
    if top > 0 {
        // Keep the `top` largest, highest first, ties by the lower id (insertion into a short list).
        for (i, &l) in logits.iter().enumerate() {
            let i = i as u32;
            if best.len() == top && l <= logits[best[top - 1] as usize] {
                continue;
            }
            let at = best.partition_point(|&b| logits[b as usize] >= l);
            best.insert(at, i);
            best.truncate(top);
        }
    }
    TokenLogprob {
        token,
        logprob: lp(token),
        top: best.into_iter().map(|t| (t, lp(t))).collect(),
    }
}

/// Index of the largest value (the first one on ties).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// A small, fast, seedable generator (SplitMix64).
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_max() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 2.0], &[], &[], None), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_respected() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 5,
            top_p: 0.9,
            seed: 42,
            ..Default::default()
        };
        let a: Vec<u32> = (0..50)
            .scan(Sampler::new(p.clone()), |s, _| Some(s.sample(&logits, &[], &[], None)))
            .collect();
        let b: Vec<u32> = (0..50)
            .scan(Sampler::new(p.clone()), |s, _| Some(s.sample(&logits, &[], &[], None)))
            .collect();
        assert_eq!(a, b);
        // top_k = 5 keeps the five ids with logit 6 (ids 6, 13, 20, 27, 34).
        assert!(a.iter().all(|&t| t % 7 == 6 && t <= 34), "{a:?}");
    }

    #[test]
    fn temperature_sampling_follows_the_distribution() {
        // Ids 0..4 with weights 1 : 2 : 4 : 8 (logits ln w); 0 never after a -inf logit.
        let logits: Vec<f32> = [f32::NEG_INFINITY, 0.0, 2f32.ln(), 4f32.ln(), 8f32.ln()].to_vec();
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        });
        let mut counts = [0usize; 5];
        for _ in 0..15_000 {
            counts[s.sample(&logits, &[], &[], None) as usize] += 1;
        }
        assert_eq!(counts[0], 0);
        for (i, w) in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0)] {
            let want = 15_000.0 * w / 15.0;
            assert!((counts[i] as f64 - want).abs() < 0.1 * want, "{counts:?}");
        }
    }

    #[test]
    fn penalties_steer_away_from_repeats() {
        let logits = [2.0f32, 1.9, -1.0];
        let greedy = |p: SamplingParams, gen: &[u32]| Sampler::new(p).sample(&logits, &[], gen, None);
        assert_eq!(greedy(SamplingParams::default(), &[0]), 0);
        // Repetition: 2.0 / 1.5 = 1.33 < 1.9.
        assert_eq!(
            greedy(
                SamplingParams {
                    repetition_penalty: 1.5,
                    ..Default::default()
                },
                &[0]
            ),
            1
        );
        // Presence: 2.0 - 0.5 < 1.9; frequency grows with each occurrence.
        assert_eq!(
            greedy(
                SamplingParams {
                    presence_penalty: 0.5,
                    ..Default::default()
                },
                &[0]
            ),
            1
        );
        assert_eq!(
            greedy(
                SamplingParams {
                    frequency_penalty: 0.06,
                    ..Default::default()
                },
                &[0]
            ),
            0
        );
        assert_eq!(
            greedy(
                SamplingParams {
                    frequency_penalty: 0.06,
                    ..Default::default()
                },
                &[0, 0]
            ),
            1
        );
        // A negative logit is pushed further down by the repetition penalty.
        let s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        assert_eq!(s.adjust(&logits, &[2], &[], None)[2], -2.0);
    }

    #[test]
    fn min_p_keeps_only_tokens_near_the_top() {
        // Token 0 has ~0.73 of the mass, token 1 ~0.27, the rest ~0; min_p 0.5 keeps only token 0.
        let logits = [1.0f32, 0.0, -20.0, -20.0];
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: 7,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        assert!((0..200).all(|_| s.sample(&logits, &[], &[], None) == 0));
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 0.3,
            seed: 7,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        let picks: Vec<u32> = (0..200).map(|_| s.sample(&logits, &[], &[], None)).collect();
        assert!(picks.contains(&0) && picks.contains(&1) && !picks.contains(&2));
    }

    #[test]
    fn validation_names_the_parameter() {
        let bad = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("top_p"));
    }

    #[test]
    fn extreme_values_are_refused_naming_the_parameter() {
        let cases = [
            (
                "repetition_penalty",
                SamplingParams {
                    repetition_penalty: 2f32.powi(64),
                    ..Default::default()
                },
            ),
            (
                "repetition_penalty",
                SamplingParams {
                    repetition_penalty: 1e-30,
                    ..Default::default()
                },
            ),
            (
                "temperature",
                SamplingParams {
                    temperature: 1e30,
                    ..Default::default()
                },
            ),
            (
                "temperature",
                SamplingParams {
                    temperature: 1e-38,
                    ..Default::default()
                },
            ),
            (
                "temperature",
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
            ),
            (
                "presence_penalty",
                SamplingParams {
                    presence_penalty: 2.5,
                    ..Default::default()
                },
            ),
            (
                "frequency_penalty",
                SamplingParams {
                    frequency_penalty: f32::INFINITY,
                    ..Default::default()
                },
            ),
            (
                "min_p",
                SamplingParams {
                    min_p: f32::NAN,
                    ..Default::default()
                },
            ),
        ];
        for (name, params) in cases {
            let message = params.validate().unwrap_err();
            assert!(message.starts_with(name), "{message}");
        }
        let edges = [
            SamplingParams {
                temperature: MAX_TEMPERATURE,
                repetition_penalty: 10.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: MIN_TEMPERATURE,
                repetition_penalty: 0.01,
                ..Default::default()
            },
        ];
        for params in edges {
            assert_eq!(params.validate(), Ok(()), "{params:?}");
        }
    }

    #[test]
    fn logprobs_are_a_normalized_log_softmax_with_the_top_tokens_in_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let lp = logprobs(&logits, 2, 3);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum::<f64>().ln();
        assert!((lp.logprob as f64 - (2.0 - z)).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2], "highest first, ties by lower id");
        let total: f64 = logits.iter().map(|&l| ((l as f64) - z).exp()).sum();
        assert!((total - 1.0).abs() < 1e-9);
        assert!(logprobs(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn bias_then_mask_then_choice() {
        let logits = [5.0, 1.0, 0.0, 3.0];
        let mut allowed = SimpleVob::alloc(3);
        allowed.allow_token(1);
        allowed.allow_token(2);
        let p = SamplingParams {
            logit_bias: vec![(2, 2.0)],
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        // Token 0 is masked, token 3 is past the mask's vocabulary, token 2's bias lifts it over 1.
        assert_eq!(
            s.adjust(&logits, &[], &[], Some(&allowed)),
            vec![f32::NEG_INFINITY, 1.0, 2.0, f32::NEG_INFINITY]
        );
        assert_eq!(s.sample(&logits, &[], &[], Some(&allowed)), 2);
        assert_eq!(s.sample(&logits, &[], &[], None), 0);
    }
}
