//! Pseudo-random prompts of token ids for the speed benches (bench-local, bench-gpu).
//! Owns the rule that ids come from the tokenizer's vocabulary: config.json's vocab_size is often padded past it.

use strata_model::tokenizer::Tokenizer;

/// Draws prompts from the ordinary tokens of one vocabulary: every id the tokenizer knows except
/// control, unknown and unused tokens and those that end a generation. The embedding matrix (and
/// `vocab_size` in config.json) is often larger than the vocabulary, Qwen2.5's 152064 rows for
/// 151665 tokens, and the engine refuses ids past the tokenizer's last one.
pub struct SyntheticPrompts {
    ordinary: Vec<u32>,
}

impl SyntheticPrompts {
    pub fn new(tokenizer: &Tokenizer) -> anyhow::Result<Self> {
        let ordinary: Vec<u32> = (0..tokenizer.vocab_size() as u32)
            .filter(|&id| !tokenizer.is_special(id) && !tokenizer.is_eog(id))
            .collect();
        anyhow::ensure!(
            !ordinary.is_empty(),
            "the model's tokenizer has no ordinary token to build a benchmark prompt from; pass another --model"
        );
        Ok(Self { ordinary })
    }

    /// `len` ids, the same for the same `seed`, different across seeds.
    pub fn prompt(&self, len: usize, seed: u64) -> Vec<u32> {
        let n = self.ordinary.len() as u64;
        (0..len as u64)
            .map(|j| {
                let hash = seed.wrapping_mul(7919).wrapping_add(j).wrapping_mul(2654435761);
                self.ordinary[(hash % n) as usize]
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer.json: `words` ordinary tokens, then `<|im_end|>` (special, EOS).
    fn small_tokenizer(dir: &std::path::Path, words: usize) -> Tokenizer {
        let vocab: serde_json::Map<String, serde_json::Value> =
            (0..words).map(|i| (format!("w{i}"), serde_json::json!(i))).collect();
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "normalizer": null, "post_processor": null,
            "decoder": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "added_tokens": [{"id": words, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
        });
        std::fs::create_dir_all(dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, tokenizer.to_string()).unwrap();
        let config = dir.join("tokenizer_config.json");
        std::fs::write(&config, r#"{"eos_token": "<|im_end|>"}"#).unwrap();
        Tokenizer::from_hf_file(&path, Some(&config)).unwrap()
    }

    #[test]
    fn ids_stay_inside_a_vocabulary_smaller_than_the_padded_config() {
        let dir = std::env::temp_dir().join(format!("strata-synthetic-prompt-{}", std::process::id()));
        // 40 words + 1 special token, as a config.json would pad to 64 rows.
        let tokenizer = small_tokenizer(&dir, 40);
        let padded_config_vocab_size = 64;
        assert!(tokenizer.vocab_size() < padded_config_vocab_size);
        let prompts = SyntheticPrompts::new(&tokenizer).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..50 {
            let prompt = prompts.prompt(512, seed);
            assert_eq!(prompt.len(), 512);
            assert!(
                prompt.iter().all(|&id| id < 40),
                "only the 40 ordinary words: {prompt:?}"
            );
            seen.extend(prompt);
        }
        assert_eq!(seen.len(), 40, "every ordinary token is drawn somewhere");
        assert_eq!(prompts.prompt(16, 7), prompts.prompt(16, 7));
        assert_ne!(prompts.prompt(16, 7), prompts.prompt(16, 8));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
