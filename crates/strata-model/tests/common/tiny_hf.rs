//! Tiny random HF checkpoints written by the tests themselves: config.json, safetensors (one file
//! or sharded with an index), a byte-level tokenizer.json with ChatML tokens, and a GGUF twin.

use std::collections::BTreeMap;
use std::path::Path;

use strata_formats::gguf::{GgufWriter, MetaValue, MetaValueType};
use strata_formats::quant::dequantize;
use strata_formats::safetensors::{serialize, Dtype};
use strata_formats::GgmlType;
use strata_model::weights::Role;

pub const HIDDEN: usize = 64;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const FFN: usize = 96;
pub const LAYERS: usize = 2;
/// 256 byte tokens, then `<|im_start|>`, `<|im_end|>`, `<|endoftext|>`.
pub const VOCAB: usize = 259;
pub const IM_END: u32 = 257;
pub const END_OF_TEXT: u32 = 258;
const THETA: f32 = 10000.0;
const EPS: f32 = 1e-5;

/// A xorshift generator of values in [-1, 1).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

/// One tensor: HF name, row-major shape, values (already rounded to the checkpoint's dtype).
pub struct Tensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub values: Vec<f32>,
}

/// A random llama-family model in HF naming.
pub struct TinyCheckpoint {
    /// `llama`, `mistral`, `qwen2` or `qwen3` (HF `model_type` and GGUF architecture alike).
    pub arch: &'static str,
    pub dtype: Dtype,
    pub tied: bool,
    pub head_dim: usize,
    /// Llama-3 RoPE scaling in config.json (llama only).
    pub llama3_rope: bool,
    pub tensors: Vec<Tensor>,
}

/// `values` stored as `ty` and read back.
fn round_to(ty: GgmlType, values: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    dequantize(ty, &encode(ty, values), &mut out).expect("plain float types dequantize");
    out
}

/// The little-endian bytes of `values` as `ty` (F32, F16 or BF16).
fn encode(ty: GgmlType, values: &[f32]) -> Vec<u8> {
    match ty {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        other => panic!("tiny checkpoints are F32, F16 or BF16, not {other}"),
    }
}

impl TinyCheckpoint {
    pub fn new(arch: &'static str, dtype: Dtype, tied: bool, seed: u64) -> TinyCheckpoint {
        let head_dim = if arch == "qwen3" { 32 } else { HIDDEN / HEADS };
        let ty = dtype.ggml_type().expect("a float dtype");
        let mut rng = Rng(seed);
        let mut tensors = Vec::new();
        let mut add = |name: String, shape: Vec<u64>, scale: f32, offset: f32, rng: &mut Rng| {
            let n = shape.iter().product::<u64>() as usize;
            let raw: Vec<f32> = (0..n).map(|_| offset + scale * rng.next()).collect();
            tensors.push(Tensor {
                name,
                shape,
                values: round_to(ty, &raw),
            });
        };
        let (q, kv) = ((HEADS * head_dim) as u64, (KV_HEADS * head_dim) as u64);
        let (h, f) = (HIDDEN as u64, FFN as u64);
        add(
            "model.embed_tokens.weight".into(),
            vec![VOCAB as u64, h],
            0.5,
            0.0,
            &mut rng,
        );
        if !tied {
            add("lm_head.weight".into(), vec![VOCAB as u64, h], 0.3, 0.0, &mut rng);
        }
        add("model.norm.weight".into(), vec![h], 0.2, 1.0, &mut rng);
        for l in 0..LAYERS {
            let n = |s: &str| format!("model.layers.{l}.{s}");
            add(n("input_layernorm.weight"), vec![h], 0.2, 1.0, &mut rng);
            add(n("post_attention_layernorm.weight"), vec![h], 0.2, 1.0, &mut rng);
            add(n("self_attn.q_proj.weight"), vec![q, h], 0.3, 0.0, &mut rng);
            add(n("self_attn.k_proj.weight"), vec![kv, h], 0.3, 0.0, &mut rng);
            add(n("self_attn.v_proj.weight"), vec![kv, h], 0.3, 0.0, &mut rng);
            add(n("self_attn.o_proj.weight"), vec![h, q], 0.3, 0.0, &mut rng);
            add(n("mlp.gate_proj.weight"), vec![f, h], 0.3, 0.0, &mut rng);
            add(n("mlp.up_proj.weight"), vec![f, h], 0.3, 0.0, &mut rng);
            add(n("mlp.down_proj.weight"), vec![h, f], 0.3, 0.0, &mut rng);
            if arch == "qwen2" {
                add(n("self_attn.q_proj.bias"), vec![q], 0.5, 0.0, &mut rng);
                add(n("self_attn.k_proj.bias"), vec![kv], 0.5, 0.0, &mut rng);
                add(n("self_attn.v_proj.bias"), vec![kv], 0.5, 0.0, &mut rng);
            }
            if arch == "qwen3" {
                add(n("self_attn.q_norm.weight"), vec![head_dim as u64], 0.2, 1.0, &mut rng);
                add(n("self_attn.k_norm.weight"), vec![head_dim as u64], 0.2, 1.0, &mut rng);
            }
        }
        TinyCheckpoint {
            arch,
            dtype,
            tied,
            head_dim,
            llama3_rope: arch == "llama",
            tensors,
        }
    }

    pub fn tensor_mut(&mut self, name: &str) -> &mut Tensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    pub fn config_json(&self) -> serde_json::Value {
        let class = match self.arch {
            "llama" => "LlamaForCausalLM",
            "mistral" => "MistralForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            _ => "Qwen3ForCausalLM",
        };
        let mut c = serde_json::json!({
            "architectures": [class], "model_type": self.arch, "hidden_act": "silu",
            "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": self.head_dim,
            "vocab_size": VOCAB, "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 256,
            "tie_word_embeddings": self.tied, "torch_dtype": "bfloat16", "bos_token_id": null,
            "eos_token_id": IM_END,
        });
        if self.llama3_rope {
            c["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            });
        }
        c
    }

    /// Writes the whole checkpoint into `dir`; with `shards > 1`, the tensors round-robin over
    /// that many files named by a `model.safetensors.index.json`.
    pub fn write_dir(&self, dir: &Path, shards: usize) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), self.config_json().to_string()).unwrap();
        self.write_weights(dir, shards);
        write_tokenizer(dir);
    }

    /// Writes only the safetensors file(s).
    pub fn write_weights(&self, dir: &Path, shards: usize) {
        let ty = self.dtype.ggml_type().expect("a float dtype");
        let encoded: Vec<Vec<u8>> = self.tensors.iter().map(|t| encode(ty, &t.values)).collect();
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        if shards <= 1 {
            let all: Vec<_> = self
                .tensors
                .iter()
                .zip(&encoded)
                .map(|(t, b)| (t.name.as_str(), self.dtype, &t.shape[..], &b[..]))
                .collect();
            std::fs::write(dir.join("model.safetensors"), serialize(&all, &meta).unwrap()).unwrap();
            return;
        }
        let mut weight_map = serde_json::Map::new();
        for s in 0..shards {
            let file = format!("model-{:05}-of-{shards:05}.safetensors", s + 1);
            let part: Vec<_> = self
                .tensors
                .iter()
                .zip(&encoded)
                .skip(s)
                .step_by(shards)
                .map(|(t, b)| (t.name.as_str(), self.dtype, &t.shape[..], &b[..]))
                .collect();
            for p in &part {
                weight_map.insert(p.0.to_string(), file.clone().into());
            }
            std::fs::write(dir.join(&file), serialize(&part, &meta).unwrap()).unwrap();
        }
        let index = serde_json::json!({ "metadata": { "total_size": 0 }, "weight_map": weight_map });
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }

    /// The same model as a GGUF file. Matrices keep the dtype, vectors are F32 (of the same
    /// rounded values). GGUF llama and mistral files pair RoPE dimensions interleaved, so, as
    /// llama.cpp's converter does, their Q and K rows are permuted within each head; qwen2 and
    /// qwen3 GGUF files keep HF's row order and half-split pairs. Llama-3 scaling becomes the
    /// `rope_freqs.weight` divisors GGUF files carry.
    pub fn write_gguf(&self, path: &Path) {
        std::fs::write(path, self.gguf_writer().to_bytes()).unwrap();
    }

    /// The writer [`Self::write_gguf`] writes, with the tokenizer of [`add_gguf_tokenizer`], for
    /// a test to change before writing.
    pub fn gguf_writer(&self) -> GgufWriter {
        let ty = self.dtype.ggml_type().expect("a float dtype");
        let interleaved = matches!(self.arch, "llama" | "mistral");
        let mut w = GgufWriter::new();
        add_gguf_hparams(&mut w, self.arch, self.head_dim, VOCAB, THETA, EPS);
        for t in &self.tensors {
            let name = gguf_name(&t.name);
            let dims: Vec<u64> = t.shape.iter().rev().copied().collect();
            let is_q = name.ends_with("attn_q.weight");
            let values = if interleaved && (is_q || name.ends_with("attn_k.weight")) {
                permute_for_interleaved(&t.values, self.head_dim, HIDDEN)
            } else {
                t.values.clone()
            };
            if t.shape.len() == 2 {
                w.add_tensor(name, &dims, ty, encode(ty, &values)).unwrap();
            } else {
                w.add_tensor(name, &dims, GgmlType::F32, encode(GgmlType::F32, &values))
                    .unwrap();
            }
        }
        if self.llama3_rope {
            let config = strata_model::hf_checkpoint::config_from_json_value(&self.config_json()).unwrap();
            let scaled = config.rope.inv_freq();
            let plain = strata_model::config::RopeConfig {
                scaling: strata_model::config::RopeScaling::None,
                ..config.rope.clone()
            }
            .inv_freq();
            let factors: Vec<f32> = plain.iter().zip(&scaled).map(|(p, s)| p / s).collect();
            w.add_tensor(
                "rope_freqs.weight",
                &[factors.len() as u64],
                GgmlType::F32,
                encode(GgmlType::F32, &factors),
            )
            .unwrap();
        }
        add_gguf_tokenizer(&mut w);
        w
    }
}

/// The tokenizer of [`write_tokenizer`] as GGUF metadata: 256 byte tokens (no merges), the ChatML
/// control tokens with `<|im_end|>` as EOS, and the ChatML template.
pub fn add_gguf_tokenizer(w: &mut GgufWriter) {
    let specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"];
    let tokens: Vec<String> = (0..=255u8)
        .map(|b| byte_char(b).to_string())
        .chain(specials.iter().map(|s| s.to_string()))
        .collect();
    let types: Vec<MetaValue> = (0..VOCAB)
        .map(|i| MetaValue::I32(if i < 256 { 1 } else { 3 }))
        .collect();
    w.add_metadata("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .unwrap();
    w.add_metadata("tokenizer.ggml.pre", MetaValue::String("gpt2".into()))
        .unwrap();
    w.add_string_array("tokenizer.ggml.tokens", tokens).unwrap();
    w.add_metadata("tokenizer.ggml.token_type", MetaValue::Array(MetaValueType::I32, types))
        .unwrap();
    w.add_string_array("tokenizer.ggml.merges", Vec::<String>::new())
        .unwrap();
    w.add_metadata("tokenizer.ggml.eos_token_id", MetaValue::U32(IM_END))
        .unwrap();
    w.add_metadata(
        "tokenizer.chat_template",
        MetaValue::String(strata_model::chat_template::CHATML_TEMPLATE.into()),
    )
    .unwrap();
}

/// `general.architecture` and the `<arch>.*` shape keys of a tiny model (the constants above).
pub fn add_gguf_hparams(w: &mut GgufWriter, arch: &str, head_dim: usize, vocab: usize, theta: f32, eps: f32) {
    let u32m = |v: usize| MetaValue::U32(v as u32);
    w.add_metadata("general.architecture", MetaValue::String(arch.into()))
        .unwrap();
    for (k, v) in [
        ("block_count", u32m(LAYERS)),
        ("embedding_length", u32m(HIDDEN)),
        ("feed_forward_length", u32m(FFN)),
        ("attention.head_count", u32m(HEADS)),
        ("attention.head_count_kv", u32m(KV_HEADS)),
        ("attention.key_length", u32m(head_dim)),
        ("vocab_size", u32m(vocab)),
        ("context_length", u32m(256)),
        ("rope.freq_base", MetaValue::F32(theta)),
        ("attention.layer_norm_rms_epsilon", MetaValue::F32(eps)),
    ] {
        w.add_metadata(format!("{arch}.{k}"), v).unwrap();
    }
}

/// The GGUF name of an HF tensor name.
fn gguf_name(hf: &str) -> String {
    (0..LAYERS)
        .flat_map(|l| Role::ALL.map(|r| (r.hf_name(l), r.gguf_name(l))))
        .find(|(h, _)| h == hf)
        .map(|(_, g)| g)
        .unwrap_or_else(|| panic!("{hf} is not a tensor of the llama family"))
}

/// llama.cpp's `permute`: within each head, row `i` of the first half goes to `2i` and row `i`
/// of the second half to `2i + 1`, so that interleaved RoPE pairs are HF's half-split pairs.
fn permute_for_interleaved(values: &[f32], head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0; values.len()];
    for (h, head) in values.chunks_exact(head_dim * cols).enumerate() {
        for r in 0..head_dim {
            let to = if r < half { 2 * r } else { 2 * (r - half) + 1 };
            let dst = (h * head_dim + to) * cols;
            out[dst..dst + cols].copy_from_slice(&head[r * cols..(r + 1) * cols]);
        }
    }
    out
}

/// GPT-2's byte-to-character table: printable bytes map to themselves, the rest to 256 + n.
fn byte_char(b: u8) -> char {
    let printable = |c: u8| (b'!'..=b'~').contains(&c) || (0xA1..=0xAC).contains(&c) || c >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + n).expect("valid code point")
}

/// A byte-level BPE tokenizer.json without merges (one token per byte) plus the ChatML tokens,
/// a tokenizer_config.json with a ChatML template, and a generation_config.json with two EOS ids.
pub fn write_tokenizer(dir: &Path) {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), u32::from(b).into()))
        .collect();
    let added: Vec<serde_json::Value> = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            serde_json::json!({"id": 256 + i, "content": t, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = serde_json::json!({
        "bos_token": null, "eos_token": "<|im_end|>", "add_bos_token": false,
        "chat_template": strata_model::chat_template::CHATML_TEMPLATE,
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let generation = serde_json::json!({ "eos_token_id": [IM_END, END_OF_TEXT] });
    std::fs::write(dir.join("generation_config.json"), generation.to_string()).unwrap();
}
