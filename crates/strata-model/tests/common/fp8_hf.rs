//! FP8 E4M3 checkpoints written by the tests themselves: a [`TinyCheckpoint`]'s layer matrices
//! in the `fp8` (per-tensor, block) or `compressed-tensors` (per-channel) layout, and the bf16 twin
//! holding the values they stand for.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use strata_formats::safetensors::{serialize, Dtype};
use strata_model::fp8::encode_row;
use strata_model::kv_cache::e4m3_to_f32;

use super::tiny_hf::{write_tokenizer, TinyCheckpoint};

/// How the test quantizes each layer matrix.
#[derive(Clone, Copy)]
pub enum Scheme {
    /// `quant_method: fp8`, one f32 scale a tensor (shape []).
    PerTensor,
    /// `compressed-tensors`, one bf16 scale a row (shape [rows, 1]).
    PerChannel,
    /// `quant_method: fp8` with `weight_block_size` [32, 32] and `weight_scale_inv`.
    Blocks,
}

/// One matrix as E4M3 bytes and its scale tensor (row-major shape, f32 values), and the values
/// it stands for (what strata dequantizes it to).
fn quantize(values: &[f32], rows: usize, cols: usize, scheme: Scheme) -> (Vec<u8>, Vec<u64>, Vec<f32>, Vec<f32>) {
    let mut q = vec![0u8; values.len()];
    let mut dequantized = vec![0.0f32; values.len()];
    let (shape, scales) = match scheme {
        Scheme::PerTensor => {
            let s = encode_row(values, None, &mut q);
            (vec![], vec![s])
        }
        Scheme::PerChannel => {
            let mut scales = Vec::new();
            for (row, out) in values.chunks_exact(cols).zip(q.chunks_exact_mut(cols)) {
                // The checkpoint keeps bf16 scales; the bytes are encoded with the rounded one.
                let s = bf16::from_f32(row.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 448.0).to_f32();
                scales.push(encode_row(row, Some(s), out));
            }
            (vec![rows as u64, 1], scales)
        }
        Scheme::Blocks => {
            let (gr, gc) = (rows.div_ceil(32), cols.div_ceil(32));
            let mut scales = vec![0.0f32; gr * gc];
            for (b, s) in scales.iter_mut().enumerate() {
                let (r0, c0) = (b / gc * 32, b % gc * 32);
                let block: Vec<f32> = (r0..(r0 + 32).min(rows))
                    .flat_map(|r| values[r * cols + c0..r * cols + (c0 + 32).min(cols)].to_vec())
                    .collect();
                let mut bq = vec![0u8; block.len()];
                *s = encode_row(&block, None, &mut bq);
                let w = (c0 + 32).min(cols) - c0;
                for (i, &byte) in bq.iter().enumerate() {
                    q[(r0 + i / w) * cols + c0 + i % w] = byte;
                }
            }
            (vec![gr as u64, gc as u64], scales)
        }
    };
    for (i, (d, &b)) in dequantized.iter_mut().zip(&q).enumerate() {
        let s = match scheme {
            Scheme::PerTensor => scales[0],
            Scheme::PerChannel => scales[i / cols],
            Scheme::Blocks => scales[(i / cols / 32) * cols.div_ceil(32) + i % cols / 32],
        };
        *d = bf16::from_f32(e4m3_to_f32(b) * s).to_f32();
    }
    (q, shape, scales, dequantized)
}

/// Writes `ck` to `dir` with every layer matrix in FP8 as `scheme` lays it out (embeddings, LM
/// head and norms stay bf16, as published checkpoints keep them), and returns the bf16 twin
/// holding the dequantized values.
pub fn write_fp8(ck: &TinyCheckpoint, dir: &Path, scheme: Scheme) -> TinyCheckpoint {
    let mut twin = TinyCheckpoint::new(ck.arch, Dtype::BF16, ck.tied, 0);
    let mut owned: Vec<(String, Dtype, Vec<u64>, Vec<u8>)> = Vec::new();
    for (t, tt) in ck.tensors.iter().zip(twin.tensors.iter_mut()) {
        let layer_matrix = t.name.starts_with("model.layers.") && t.shape.len() == 2;
        if !layer_matrix {
            let bytes = t.values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
            owned.push((t.name.clone(), Dtype::BF16, t.shape.clone(), bytes));
            tt.values = t.values.clone();
            continue;
        }
        let (rows, cols) = (t.shape[0] as usize, t.shape[1] as usize);
        let (q, shape, scales, dequantized) = quantize(&t.values, rows, cols, scheme);
        owned.push((t.name.clone(), Dtype::F8E4M3, t.shape.clone(), q));
        let (suffix, dtype, bytes): (&str, Dtype, Vec<u8>) = match scheme {
            Scheme::PerChannel => (
                "_scale",
                Dtype::BF16,
                scales.iter().flat_map(|&s| bf16::from_f32(s).to_le_bytes()).collect(),
            ),
            Scheme::PerTensor => ("_scale", Dtype::F32, scales[0].to_le_bytes().to_vec()),
            Scheme::Blocks => (
                "_scale_inv",
                Dtype::F32,
                scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            ),
        };
        owned.push((format!("{}{suffix}", t.name), dtype, shape, bytes));
        if matches!(scheme, Scheme::PerTensor) {
            // A static activation scale, as such checkpoints carry (strata scales activations itself).
            let input = t.name.replace(".weight", ".input_scale");
            owned.push((input, Dtype::F32, vec![], 1.0f32.to_le_bytes().to_vec()));
        }
        tt.values = dequantized;
    }
    let tensors: Vec<_> = owned
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, &s[..], &b[..]))
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("model.safetensors"),
        serialize(&tensors, &BTreeMap::new()).unwrap(),
    )
    .unwrap();
    let mut config = ck.config_json();
    config["quantization_config"] = match scheme {
        Scheme::PerTensor => serde_json::json!({"quant_method": "fp8", "activation_scheme": "static"}),
        Scheme::Blocks => serde_json::json!({"quant_method": "fp8", "activation_scheme": "dynamic",
                                              "fmt": "e4m3", "weight_block_size": [32, 32]}),
        Scheme::PerChannel => serde_json::json!({
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}}}),
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    write_tokenizer(dir);
    twin
}
