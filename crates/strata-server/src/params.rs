//! The generation fields chat and completion requests share (sampling, n, stop, seed, logprobs,
//! logit_bias, response_format, streaming), checked with errors naming the field and turned into
//! engine requests.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use strata_engine::request::MAX_TOP_LOGPROBS;
use strata_engine::sampler::MIN_TEMPERATURE;
use strata_engine::{GenerationRequest, SamplingParams};

use crate::error::ApiError;
use crate::protocol::{StopField, StreamOptions};
use crate::response_format::{output_constraint, GrammarCheck};

/// Most choices one request may ask for.
pub const MAX_N: u64 = 128;
/// Most stop strings, and bytes in one: every generated token is checked against each of
/// them (OpenAI allows 4).
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 512;
/// Most stop token ids (each generated token is looked up among them).
pub const MAX_STOP_TOKEN_IDS: usize = 1024;
/// Highest `temperature` (OpenAI's; the engine itself takes up to 100 for the CLI).
pub const MAX_API_TEMPERATURE: f32 = 2.0;
/// Most `logit_bias` entries (each is applied to every step's logits).
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 1024;
/// `logit_bias` values lie in [-100, 100] (OpenAI's range: -100 bans a token, 100 forces it).
pub const MAX_LOGIT_BIAS: f64 = 100.0;

/// The shared fields, borrowed from either request type.
pub struct GenerationFields<'a> {
    /// The max-tokens value and the name of the field it came from.
    pub max_tokens: Option<(u64, &'static str)>,
    /// Used when no max-tokens field is given.
    pub default_max_tokens: usize,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub n: Option<u64>,
    pub stop: Option<&'a StopField>,
    pub stop_token_ids: Option<&'a [u32]>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// Alternatives per token, with the field name that asked for them.
    pub logprobs: Option<(u64, &'static str)>,
    pub ignore_eos: Option<bool>,
    pub speculative: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<&'a StreamOptions>,
    /// Token id (as a string) -> bias added to its logit.
    pub logit_bias: Option<&'a BTreeMap<String, f64>>,
    pub response_format: Option<&'a serde_json::Value>,
}

/// A checked request, ready to be submitted `n` times per prompt.
#[derive(Debug, Clone)]
pub struct GenerationPlan {
    /// Everything but the prompt and the seed.
    pub template: GenerationRequest,
    /// The field the client's max-tokens value came from; `None`: the default was used.
    pub max_tokens_field: Option<&'static str>,
    pub n: usize,
    pub seed: Option<u64>,
    pub stream: bool,
    pub include_usage: bool,
}

impl GenerationPlan {
    /// The `n` engine requests for one prompt: seeds `seed + i`, or fresh random seeds.
    pub fn requests(&self, prompt: &[u32]) -> Vec<GenerationRequest> {
        (0..self.n)
            .map(|i| {
                let mut r = self.template.clone();
                r.prompt = prompt.to_vec();
                r.sampling.seed = match self.seed {
                    Some(s) => s.wrapping_add(i as u64),
                    None => random_u64(),
                };
                r
            })
            .collect()
    }

    /// Refuses (400, `context_length_exceeded`) a prompt of `prompt_tokens` that leaves less room
    /// than the client's max tokens in `max_model_len`, as OpenAI does, with all three numbers;
    /// without a max tokens given, generation simply stops where the context ends.
    pub fn check_room(&self, prompt_tokens: usize, max_model_len: usize, prompt_field: &str) -> Result<(), ApiError> {
        let Some(field) = self.max_tokens_field else {
            return Ok(());
        };
        let max_tokens = self.template.max_tokens;
        let total = prompt_tokens.saturating_add(max_tokens);
        if total <= max_model_len {
            return Ok(());
        }
        Err(ApiError::context_length_exceeded(
            field,
            format!(
                "this model's maximum context length is {max_model_len} tokens, but you requested {total} tokens \
                 ({prompt_tokens} in the {prompt_field} and {max_tokens} in `{field}`); reduce the length of the \
                 {prompt_field} or `{field}` (at most {} here)",
                max_model_len.saturating_sub(prompt_tokens)
            ),
        ))
    }
}

/// `logit_bias` as the engine takes it, sorted by token id: keys must be token ids of the
/// vocabulary written as decimal integers, values finite and in [-100, 100].
pub fn logit_bias(map: &BTreeMap<String, f64>, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let refuse = |why: String| ApiError::invalid_field("logit_bias", format!("`logit_bias`: {why}"));
    if map.len() > MAX_LOGIT_BIAS_ENTRIES {
        return Err(refuse(format!(
            "at most {MAX_LOGIT_BIAS_ENTRIES} tokens may be biased, got {}",
            map.len()
        )));
    }
    let mut biases = Vec::with_capacity(map.len());
    for (key, &bias) in map {
        let id = key
            .parse::<u32>()
            .ok()
            .filter(|id| id.to_string() == *key)
            .ok_or_else(|| refuse(format!("the key {key:?} is not a token id (a decimal integer)")))?;
        if id as usize >= vocab_size {
            return Err(refuse(format!(
                "token id {id} is outside the vocabulary of {vocab_size}"
            )));
        }
        if !(bias.is_finite() && (-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&bias)) {
            return Err(refuse(format!(
                "the bias of token {id} must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias}"
            )));
        }
        biases.push((id, bias as f32));
    }
    biases.sort_unstable_by_key(|&(id, _)| id);
    Ok(biases)
}

fn as_f32(v: Option<f64>, default: f32, name: &str) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && x.abs() <= f32::MAX as f64 => Ok(x as f32),
        Some(x) => Err(ApiError::invalid_field(
            name,
            format!("`{name}` must be a finite number, got {x}"),
        )),
    }
}

/// Checks the shared fields; token ids against a vocabulary of `vocab_size`, `response_format`
/// with `grammar`.
pub fn plan(f: &GenerationFields, vocab_size: usize, grammar: &GrammarCheck) -> Result<GenerationPlan, ApiError> {
    let max_tokens = match f.max_tokens {
        Some((0, name)) => return Err(ApiError::invalid_field(name, format!("`{name}` must be at least 1"))),
        Some((v, _)) => usize::try_from(v).unwrap_or(usize::MAX),
        None => f.default_max_tokens,
    };
    let n = f.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::invalid_field(
            "n",
            format!("`n` must be in 1..={MAX_N}, got {n}"),
        ));
    }
    let top_k = match f.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        k => {
            return Err(ApiError::invalid_field(
                "top_k",
                format!("`top_k` must be -1, 0 (no limit) or positive, got {k}"),
            ))
        }
    };
    let mut temperature = as_f32(f.temperature, 1.0, "temperature")?;
    if !(0.0..=MAX_API_TEMPERATURE).contains(&temperature) {
        return Err(ApiError::invalid_field(
            "temperature",
            format!("`temperature` must be in [0, {MAX_API_TEMPERATURE}], got {temperature}"),
        ));
    }
    if temperature > 0.0 && temperature < MIN_TEMPERATURE {
        temperature = 0.0;
    }
    let sampling = SamplingParams {
        temperature,
        top_k,
        top_p: as_f32(f.top_p, 1.0, "top_p")?,
        min_p: as_f32(f.min_p, 0.0, "min_p")?,
        repetition_penalty: as_f32(f.repetition_penalty, 1.0, "repetition_penalty")?,
        presence_penalty: as_f32(f.presence_penalty, 0.0, "presence_penalty")?,
        frequency_penalty: as_f32(f.frequency_penalty, 0.0, "frequency_penalty")?,
        logit_bias: match f.logit_bias {
            Some(map) => logit_bias(map, vocab_size)?,
            None => Vec::new(),
        },
        seed: 0,
    };
    sampling
        .validate()
        .map_err(|m| ApiError::from_submit(strata_engine::SubmitError::Invalid(m), "prompt"))?;
    let stop: Vec<String> = match f.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid_field(
            "stop",
            format!("`stop` may hold at most {MAX_STOP_STRINGS} strings, got {}", stop.len()),
        ));
    }
    if let Some(i) = stop.iter().position(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        let param = if matches!(f.stop, Some(StopField::Many(_))) {
            format!("stop[{i}]")
        } else {
            "stop".into()
        };
        return Err(ApiError::invalid_field(
            param.clone(),
            format!("`{param}` must be a non-empty string of at most {MAX_STOP_BYTES} bytes"),
        ));
    }
    let stop_token_ids = f.stop_token_ids.unwrap_or_default();
    if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid_field(
            "stop_token_ids",
            format!(
                "`stop_token_ids` may hold at most {MAX_STOP_TOKEN_IDS} ids, got {}",
                stop_token_ids.len()
            ),
        ));
    }
    let logprobs = match f.logprobs {
        None => None,
        Some((k, name)) if k > MAX_TOP_LOGPROBS as u64 => {
            return Err(ApiError::invalid_field(
                name,
                format!("`{name}` must be at most {MAX_TOP_LOGPROBS}, got {k}"),
            ))
        }
        Some((k, _)) => Some(k as usize),
    };
    let stream = f.stream.unwrap_or(false);
    if f.stream_options.is_some() && !stream {
        return Err(ApiError::invalid_field(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true",
        ));
    }
    let constraint = match f.response_format {
        Some(format) => output_constraint(format, grammar)?,
        None => None,
    };
    Ok(GenerationPlan {
        max_tokens_field: f.max_tokens.map(|(_, name)| name),
        template: GenerationRequest {
            prompt: Vec::new(),
            sampling,
            max_tokens,
            stop,
            stop_token_ids: stop_token_ids.to_vec(),
            ignore_eos: f.ignore_eos.unwrap_or(false),
            logprobs,
            constraint,
            speculative: f.speculative.unwrap_or(true),
        },
        n: n as usize,
        seed: f.seed.map(|s| s as u64),
        stream,
        include_usage: f.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
    })
}

/// A random 64-bit value (request ids, seeds of requests that gave none).
pub fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields() -> GenerationFields<'static> {
        GenerationFields {
            max_tokens: None,
            default_max_tokens: 16,
            temperature: None,
            top_p: None,
            top_k: None,
            min_p: None,
            n: None,
            stop: None,
            stop_token_ids: None,
            seed: None,
            presence_penalty: None,
            frequency_penalty: None,
            repetition_penalty: None,
            logprobs: None,
            ignore_eos: None,
            speculative: None,
            stream: None,
            stream_options: None,
            logit_bias: None,
            response_format: None,
        }
    }

    const VOCAB: usize = 1000;

    fn plan(f: &GenerationFields) -> Result<GenerationPlan, ApiError> {
        super::plan(f, VOCAB, &GrammarCheck::unavailable())
    }

    #[test]
    fn defaults_and_seeds() {
        let p = plan(&GenerationFields {
            n: Some(3),
            seed: Some(7),
            ..fields()
        })
        .unwrap();
        assert_eq!(p.template.max_tokens, 16);
        let seeds: Vec<u64> = p.requests(&[1, 2]).iter().map(|r| r.sampling.seed).collect();
        assert_eq!(seeds, vec![7, 8, 9]);
        let p = plan(&GenerationFields { n: Some(2), ..fields() }).unwrap();
        let r = p.requests(&[1]);
        assert_ne!(r[0].sampling.seed, r[1].sampling.seed, "unseeded choices differ");
    }

    #[test]
    fn temperatures_too_small_to_divide_by_are_greedy() {
        let p = plan(&GenerationFields {
            temperature: Some(1e-9),
            ..fields()
        })
        .unwrap();
        assert_eq!(p.template.sampling.temperature, 0.0);
        let p = plan(&GenerationFields {
            temperature: Some(0.5),
            ..fields()
        })
        .unwrap();
        assert_eq!(p.template.sampling.temperature, 0.5);
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases: Vec<(GenerationFields, &str)> = vec![
            (
                GenerationFields {
                    max_tokens: Some((0, "max_completion_tokens")),
                    ..fields()
                },
                "max_completion_tokens",
            ),
            (GenerationFields { n: Some(0), ..fields() }, "n"),
            (
                GenerationFields {
                    temperature: Some(-1.0),
                    ..fields()
                },
                "temperature",
            ),
            (
                GenerationFields {
                    temperature: Some(1e300),
                    ..fields()
                },
                "temperature",
            ),
            (
                GenerationFields {
                    top_p: Some(0.0),
                    ..fields()
                },
                "top_p",
            ),
            (
                GenerationFields {
                    top_k: Some(-5),
                    ..fields()
                },
                "top_k",
            ),
            (
                GenerationFields {
                    min_p: Some(2.0),
                    ..fields()
                },
                "min_p",
            ),
            (
                GenerationFields {
                    presence_penalty: Some(3.0),
                    ..fields()
                },
                "presence_penalty",
            ),
            (
                GenerationFields {
                    frequency_penalty: Some(-3.0),
                    ..fields()
                },
                "frequency_penalty",
            ),
            (
                GenerationFields {
                    repetition_penalty: Some(0.0),
                    ..fields()
                },
                "repetition_penalty",
            ),
            (
                GenerationFields {
                    repetition_penalty: Some(2f64.powi(64)),
                    ..fields()
                },
                "repetition_penalty",
            ),
            (
                GenerationFields {
                    temperature: Some(101.0),
                    ..fields()
                },
                "temperature",
            ),
            (
                GenerationFields {
                    temperature: Some(2.01),
                    ..fields()
                },
                "temperature",
            ),
            (
                GenerationFields {
                    logprobs: Some((21, "top_logprobs")),
                    ..fields()
                },
                "top_logprobs",
            ),
            (
                GenerationFields {
                    stream_options: Some(&StreamOptions {
                        include_usage: Some(true),
                    }),
                    ..fields()
                },
                "stream_options",
            ),
        ];
        for (f, want) in cases {
            let e = plan(&f).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(want), "{}", e.message);
        }
        let many = StopField::Many(vec!["x".into(); MAX_STOP_STRINGS + 1]);
        let e = plan(&GenerationFields {
            stop: Some(&many),
            ..fields()
        })
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        let long = StopField::One("x".repeat(MAX_STOP_BYTES + 1));
        let e = plan(&GenerationFields {
            stop: Some(&long),
            ..fields()
        })
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        let ids = vec![1u32; MAX_STOP_TOKEN_IDS + 1];
        let e = plan(&GenerationFields {
            stop_token_ids: Some(&ids),
            ..fields()
        })
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop_token_ids"));
        let stop = StopField::Many(vec!["a".into(), String::new()]);
        let e = plan(&GenerationFields {
            stop: Some(&stop),
            ..fields()
        })
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop[1]"));
    }

    #[test]
    fn temperature_two_is_the_top() {
        let p = plan(&GenerationFields {
            temperature: Some(2.0),
            ..fields()
        })
        .unwrap();
        assert_eq!(p.template.sampling.temperature, 2.0);
    }

    #[test]
    fn logit_bias_becomes_sorted_pairs() {
        let map: BTreeMap<String, f64> = [("999", -100.0), ("10", 5.5), ("2", 100.0)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let p = plan(&GenerationFields {
            logit_bias: Some(&map),
            ..fields()
        })
        .unwrap();
        assert_eq!(
            p.template.sampling.logit_bias,
            vec![(2, 100.0), (10, 5.5), (999, -100.0)]
        );
    }

    #[test]
    fn bad_logit_bias_is_named() {
        let too_many: BTreeMap<String, f64> = (0..=MAX_LOGIT_BIAS_ENTRIES).map(|i| (i.to_string(), 1.0)).collect();
        let bad = |k: &str, v: f64| BTreeMap::from([(k.to_string(), v)]);
        let cases = [
            (bad("1000", 1.0), "outside the vocabulary of 1000"),
            (bad("-1", 1.0), "not a token id"),
            (bad("01", 1.0), "not a token id"),
            (bad("+1", 1.0), "not a token id"),
            (bad("abc", 1.0), "not a token id"),
            (bad("1.5", 1.0), "not a token id"),
            (bad("5", 100.5), "in [-100, 100]"),
            (bad("5", -101.0), "in [-100, 100]"),
            (bad("5", f64::NAN), "in [-100, 100]"),
            (too_many, "at most 1024"),
        ];
        for (map, says) in cases {
            let e = plan(&GenerationFields {
                logit_bias: Some(&map),
                ..fields()
            })
            .unwrap_err();
            assert_eq!(e.param.as_deref(), Some("logit_bias"), "{}", e.message);
            assert!(e.message.contains(says), "{}", e.message);
        }
    }

    #[test]
    fn max_tokens_that_cannot_fit_are_refused_with_the_numbers() {
        let p = plan(&GenerationFields {
            max_tokens: Some((100, "max_completion_tokens")),
            ..fields()
        })
        .unwrap();
        assert!(p.check_room(924, 1024, "messages").is_ok());
        let e = p.check_room(925, 1024, "messages").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
        assert_eq!(e.code, Some("context_length_exceeded"));
        for n in ["1024", "1025", "925", "100", "at most 99"] {
            assert!(e.message.contains(n), "{n}: {}", e.message);
        }
        // The default (no max tokens given) is whatever fits.
        let p = plan(&fields()).unwrap();
        assert_eq!(p.max_tokens_field, None);
        assert!(p.check_room(1023, 1024, "prompt").is_ok());
    }
}
