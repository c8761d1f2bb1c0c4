//! Random weights in a `config.json`'s shape for `strata quantize --random-weights`: tensor list,
//! hyper-parameter metadata and seeded values, so a large test model is written without its bytes on disk.

use std::path::Path;

use anyhow::bail;
use strata_bench::SeededRng;
use strata_formats::gguf::{GgufFile, MetaValue, TensorInfo};
use strata_formats::GgmlType;
use strata_model::config::{ModelConfig, RopeScaling};
use strata_model::hf_checkpoint::read_hf_config;
use strata_model::weights::Role;

/// Standard deviation of the random matrix values (the usual initializer range of these models).
const WEIGHT_STD: f32 = 0.02;

/// A model of a `config.json`'s shape whose values come from a seed.
pub struct RandomModel {
    pub config: ModelConfig,
    seed: u64,
}

impl RandomModel {
    /// The shape of the checkpoint `config_json` names (its directory or the file), checked
    /// against the vocabulary of `template`, whose tokenizer the written file keeps.
    pub fn new(config_json: &Path, template: &GgufFile, seed: u64) -> anyhow::Result<RandomModel> {
        let config = read_hf_config(config_json)?.model;
        let arch = config.arch.name;
        let template_arch = template.get_str("general.architecture").unwrap_or("none");
        if template_arch != arch {
            bail!(
                "{} is a {arch} model but the template GGUF is {template_arch}; pass a template of \
                 the same architecture and tokenizer",
                config_json.display()
            );
        }
        let tokens = template.get_array("tokenizer.ggml.tokens").map_or(0, |t| t.len());
        if tokens != config.vocab_size {
            bail!(
                "{} has vocab_size {} but the template's tokenizer has {tokens} tokens; pass a \
                 template GGUF of the same model family",
                config_json.display(),
                config.vocab_size
            );
        }
        if !matches!(config.rope.scaling, RopeScaling::None | RopeScaling::Linear { .. }) {
            bail!(
                "{}: random weights support no rope_scaling or linear only",
                config_json.display()
            );
        }
        Ok(RandomModel { config, seed })
    }

    /// The `<arch>.*` hyper-parameters of the shape, as GGUF writes them.
    pub fn hparams(&self) -> Vec<(String, MetaValue)> {
        let c = &self.config;
        let key = |suffix: &str| format!("{}.{suffix}", c.arch.name);
        let count = |n: usize| MetaValue::U32(n as u32);
        let mut keys = vec![
            (key("block_count"), count(c.n_layers)),
            (key("context_length"), count(c.max_position)),
            (key("embedding_length"), count(c.hidden)),
            (key("feed_forward_length"), count(c.intermediate)),
            (key("attention.head_count"), count(c.n_heads)),
            (key("attention.head_count_kv"), count(c.n_kv_heads)),
            (key("attention.key_length"), count(c.head_dim)),
            (key("attention.value_length"), count(c.head_dim)),
            (key("attention.layer_norm_rms_epsilon"), MetaValue::F32(c.rms_eps)),
            (key("rope.freq_base"), MetaValue::F32(c.rope.theta)),
            (key("rope.dimension_count"), count(c.rope.dim)),
            (key("vocab_size"), count(c.vocab_size)),
        ];
        if let RopeScaling::Linear { factor } = c.rope.scaling {
            keys.push((key("rope.scaling.type"), MetaValue::String("linear".into())));
            keys.push((key("rope.scaling.factor"), MetaValue::F32(factor)));
        }
        keys
    }

    /// Every tensor of the shape, in llama.cpp's order, as F32 (what the values are made as).
    pub fn tensors(&self) -> Vec<TensorInfo> {
        let c = &self.config;
        let mut shapes: Vec<(String, Vec<u64>)> = vec![(Role::TokenEmbd.gguf_name(0), dims(c.hidden, c.vocab_size))];
        shapes.push((Role::OutputNorm.gguf_name(0), vec![c.hidden as u64]));
        if !c.tied_embeddings {
            shapes.push((Role::Output.gguf_name(0), dims(c.hidden, c.vocab_size)));
        }
        for l in 0..c.n_layers {
            let mut layer = vec![
                (Role::AttnNorm, vec![c.hidden as u64]),
                (Role::Q, dims(c.hidden, c.q_dim())),
                (Role::K, dims(c.hidden, c.kv_dim())),
                (Role::V, dims(c.hidden, c.kv_dim())),
                (Role::O, dims(c.q_dim(), c.hidden)),
            ];
            if c.arch.qkv_bias {
                layer.push((Role::QBias, vec![c.q_dim() as u64]));
                layer.push((Role::KBias, vec![c.kv_dim() as u64]));
                layer.push((Role::VBias, vec![c.kv_dim() as u64]));
            }
            if c.arch.qk_norm {
                layer.push((Role::QNorm, vec![c.head_dim as u64]));
                layer.push((Role::KNorm, vec![c.head_dim as u64]));
            }
            layer.extend([
                (Role::FfnNorm, vec![c.hidden as u64]),
                (Role::Gate, dims(c.hidden, c.intermediate)),
                (Role::Up, dims(c.hidden, c.intermediate)),
                (Role::Down, dims(c.intermediate, c.hidden)),
            ]);
            shapes.extend(layer.into_iter().map(|(role, d)| (role.gguf_name(l), d)));
        }
        shapes
            .into_iter()
            .map(|(name, dims)| {
                let n_elements = dims.iter().product();
                TensorInfo {
                    name,
                    dims,
                    ty: GgmlType::F32,
                    offset: 0,
                    n_elements,
                    n_bytes: 4 * n_elements,
                }
            })
            .collect()
    }

    /// Fills `values` with row `row` of tensor `name`: 1 for norm gains, else uniform values of
    /// standard deviation 0.02 that depend only on the seed, the name and the row.
    pub fn fill_row(&self, name: &str, row: usize, values: &mut [f32]) {
        if name.ends_with("norm.weight") {
            values.fill(1.0);
            return;
        }
        let mut rng = SeededRng::new(self.seed ^ name_hash(name) ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        // Uniform on [-a, a] has standard deviation a / sqrt(3).
        let a = WEIGHT_STD * 3f32.sqrt();
        for v in values {
            *v = (2.0 * rng.next_f64() as f32 - 1.0) * a;
        }
    }
}

/// GGML dimensions (`[columns, rows]`) of a `rows x cols` matrix.
fn dims(cols: usize, rows: usize) -> Vec<u64> {
    vec![cols as u64, rows as u64]
}

/// FNV-1a of `name`: a seed per tensor that does not depend on tensor order.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}
