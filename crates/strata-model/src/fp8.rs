//! FP8 E4M3 weights: the `quantization_config` layouts of published FP8 checkpoints (`fp8`,
//! `compressed-tensors`), their matrices dequantized to bf16 at load, and E4M3 rows with scales.

use half::bf16;
use serde_json::{Map, Value};
use strata_formats::quant::dequantize;

use crate::kv_cache::{e4m3_to_f32, encode_fp8, f32_to_e4m3};

/// What a checkpoint's `quantization_config` says about its FP8 matrices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Checkpoint {
    /// The scale tensor of matrix `X.weight` is `X.weight` + this (`_scale` or `_scale_inv`).
    scale_suffix: &'static str,
    /// Rows and columns one scale covers in block-scaled checkpoints (`weight_block_size`).
    block: Option<(usize, usize)>,
}

/// The one-line list of what strata reads, for errors.
const READS: &str = "strata reads FP8 E4M3 checkpoints (quant_method fp8 or compressed-tensors float-quantized, \
                     per-tensor, per-channel or block scales) and GGUF files";

impl Fp8Checkpoint {
    /// The FP8 layout of a parsed `config.json`: `None` without a `quantization_config`, an
    /// error naming what is wrong for a method or variant strata does not read.
    pub fn from_config(json: &Map<String, Value>) -> Result<Option<Fp8Checkpoint>, String> {
        let Some(q) = json.get("quantization_config").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let q = q.as_object().ok_or("quantization_config is not an object")?;
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("(none)");
        match method {
            "fp8" => {
                if let Some(fmt) = q.get("fmt").and_then(Value::as_str).filter(|f| *f != "e4m3") {
                    return Err(format!("quantization_config fmt '{fmt}' is not supported; {READS}"));
                }
                let block = match q.get("weight_block_size").filter(|v| !v.is_null()) {
                    None => None,
                    Some(v) => Some(block_size(v).map_err(|e| format!("quantization_config weight_block_size {e}"))?),
                };
                let scale_suffix = if block.is_some() { "_scale_inv" } else { "_scale" };
                Ok(Some(Fp8Checkpoint { scale_suffix, block }))
            }
            "compressed-tensors" => compressed_tensors(q).map(Some),
            other => Err(format!(
                "quantization_config quant_method '{other}' is not supported; {READS}"
            )),
        }
    }

    /// The name of the scale tensor of matrix `name`.
    pub fn scale_name(&self, name: &str) -> String {
        format!("{name}{}", self.scale_suffix)
    }

    /// The scales of a `rows x cols` matrix from its scale tensor (`shape` row-major, `values`
    /// as f32): one for the tensor, one per row, or one per block.
    pub fn scales(&self, shape: &[u64], values: Vec<f32>, rows: usize, cols: usize) -> Result<Fp8Scales, String> {
        if values.iter().any(|s| !s.is_finite()) {
            return Err("has a scale that is not finite".into());
        }
        let n = values.len();
        if let Some((br, bc)) = self.block {
            let want = [rows.div_ceil(br) as u64, cols.div_ceil(bc) as u64];
            if shape != want {
                return Err(format!(
                    "has shape {shape:?}; {br}x{bc} blocks of a {rows}x{cols} matrix need {want:?}"
                ));
            }
            return Ok(Fp8Scales::Blocks {
                rows: br,
                cols: bc,
                grid_cols: want[1] as usize,
                scales: values,
            });
        }
        match n {
            1 => Ok(Fp8Scales::Rows(vec![values[0]; rows])),
            _ if n == rows && shape.iter().filter(|&&d| d != 1).count() == 1 => Ok(Fp8Scales::Rows(values)),
            _ => Err(format!(
                "has shape {shape:?}; a {rows}x{cols} matrix takes one scale, or one per output row ([{rows}] or [{rows}, 1])"
            )),
        }
    }
}

/// `[rows, cols]` of a block size.
fn block_size(v: &Value) -> Result<(usize, usize), String> {
    let dims: Option<Vec<usize>> = v
        .as_array()
        .map(|a| {
            a.iter()
                .map(|d| d.as_u64().filter(|&d| d > 0).map(|d| d as usize))
                .collect()
        })
        .unwrap_or_default();
    match dims.as_deref() {
        Some(&[r, c]) => Ok((r, c)),
        _ => Err(format!("= {v} is not [rows, columns]")),
    }
}

/// A `compressed-tensors` config: every group's weights 8-bit floats, by tensor, channel or block.
fn compressed_tensors(q: &Map<String, Value>) -> Result<Fp8Checkpoint, String> {
    let format = q.get("format").and_then(Value::as_str).unwrap_or("(none)");
    if !matches!(format, "float-quantized" | "naive-quantized") {
        return Err(format!(
            "compressed-tensors format '{format}' is not supported (float-quantized only); {READS}"
        ));
    }
    let groups = q
        .get("config_groups")
        .and_then(Value::as_object)
        .filter(|g| !g.is_empty())
        .ok_or("compressed-tensors quantization_config has no config_groups")?;
    let mut block = None;
    for (name, g) in groups {
        let w = g
            .get("weights")
            .and_then(Value::as_object)
            .ok_or_else(|| format!("compressed-tensors group {name} has no weights scheme"))?;
        let field = |k: &str| w.get(k).cloned().unwrap_or(Value::Null);
        let (ty, bits) = (field("type"), field("num_bits"));
        if ty != "float" || bits != 8 {
            return Err(format!(
                "compressed-tensors group {name} has {bits}-bit {ty} weights; {READS}",
                ty = ty.as_str().unwrap_or("?")
            ));
        }
        match field("strategy").as_str().unwrap_or("(none)") {
            "tensor" | "channel" => {}
            "block" => block = Some(block_size(&field("block_structure")).map_err(|e| format!("block_structure {e}"))?),
            other => {
                return Err(format!(
                    "compressed-tensors group {name} scales its weights by '{other}'; {READS}"
                ))
            }
        }
    }
    Ok(Fp8Checkpoint {
        scale_suffix: "_scale",
        block,
    })
}

/// How an FP8 matrix's values are scaled: value = e4m3 byte × scale.
#[derive(Debug, Clone, PartialEq)]
pub enum Fp8Scales {
    /// One scale per output row (a per-tensor scale repeated).
    Rows(Vec<f32>),
    /// One scale per block of `rows x cols` values, the blocks row-major, `grid_cols` a row.
    Blocks {
        rows: usize,
        cols: usize,
        grid_cols: usize,
        scales: Vec<f32>,
    },
}

impl Fp8Scales {
    /// The scale of row `r`'s columns from `c` on, up to the next block edge: (scale, columns).
    fn run(&self, r: usize, c: usize, cols: usize) -> (f32, usize) {
        match self {
            Fp8Scales::Rows(s) => (s[r], cols - c),
            Fp8Scales::Blocks {
                rows: br,
                cols: bc,
                grid_cols,
                scales,
            } => (scales[(r / br) * grid_cols + c / bc], (bc - c % bc).min(cols - c)),
        }
    }

    /// The per-row scales, when there is one per row.
    pub fn per_row(&self) -> Option<Vec<f32>> {
        match self {
            Fp8Scales::Rows(s) => Some(s.clone()),
            Fp8Scales::Blocks { .. } => None,
        }
    }

    /// `bytes` (E4M3, rows of `cols`) as little-endian bf16 values in `out`: exact, since
    /// bf16 keeps an E4M3 mantissa times any f32 scale to 2^-9.
    pub fn dequantize_to_bf16(&self, bytes: &[u8], cols: usize, out: &mut [u8]) {
        for (r, (row, dst)) in bytes.chunks_exact(cols).zip(out.chunks_exact_mut(2 * cols)).enumerate() {
            let mut c = 0;
            while c < cols {
                let (s, n) = self.run(r, c, cols);
                for (q, d) in row[c..c + n].iter().zip(dst[2 * c..2 * (c + n)].chunks_exact_mut(2)) {
                    d.copy_from_slice(&bf16::from_f32(e4m3_to_f32(*q) * s).to_le_bytes());
                }
                c += n;
            }
        }
    }
}

/// The values of a scale tensor (F32, BF16 or F16) as f32.
pub fn scale_values(ty: strata_formats::GgmlType, n: usize, bytes: &[u8]) -> Result<Vec<f32>, String> {
    let mut out = vec![0.0f32; n];
    dequantize(ty, bytes, &mut out).map_err(|e| e.to_string())?;
    Ok(out)
}

/// Encodes one row as E4M3 into `out` with `scale` (a checkpoint's: its values re-encode to its
/// bytes exactly), or with max |value| / 448 when `None`; returns the scale.
pub fn encode_row(values: &[f32], scale: Option<f32>, out: &mut [u8]) -> f32 {
    match scale {
        Some(s) if s > 0.0 => {
            for (o, &v) in out.iter_mut().zip(values) {
                *o = f32_to_e4m3(v / s);
            }
            s
        }
        _ => encode_fp8(values, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(q: &str) -> Result<Option<Fp8Checkpoint>, String> {
        let json: Map<String, Value> = serde_json::from_str(&format!(r#"{{"quantization_config": {q}}}"#)).unwrap();
        Fp8Checkpoint::from_config(&json)
    }

    #[test]
    fn each_published_layout_names_its_scales() {
        let per_tensor = config(r#"{"quant_method": "fp8", "activation_scheme": "static"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(per_tensor.scale_name("a.weight"), "a.weight_scale");
        let blocks = config(r#"{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            (blocks.scale_name("a.weight"), blocks.block),
            ("a.weight_scale_inv".into(), Some((128, 128)))
        );
        let ct = r#"{"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
              "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}}}"#;
        let ct = config(ct).unwrap().unwrap();
        assert_eq!((ct.scale_name("b.weight"), ct.block), ("b.weight_scale".into(), None));
        let json: Map<String, Value> = serde_json::from_str(r#"{"hidden_size": 8}"#).unwrap();
        assert_eq!(Fp8Checkpoint::from_config(&json), Ok(None));
    }

    #[test]
    fn other_methods_and_variants_are_refused_in_one_line() {
        let ct = |weights: &str| {
            format!(
                r#"{{"quant_method": "compressed-tensors", "format": "float-quantized",
                   "config_groups": {{"group_0": {{"weights": {weights}}}}}}}"#
            )
        };
        let cases = [
            (
                r#"{"quant_method": "awq", "bits": 4}"#.to_string(),
                "quant_method 'awq'",
            ),
            (r#"{"quant_method": "fp8", "fmt": "e5m2"}"#.to_string(), "fmt 'e5m2'"),
            (
                r#"{"quant_method": "fp8", "weight_block_size": [128]}"#.to_string(),
                "weight_block_size",
            ),
            (
                r#"{"quant_method": "compressed-tensors", "format": "pack-quantized"}"#.to_string(),
                "format 'pack-quantized'",
            ),
            (
                ct(r#"{"num_bits": 8, "type": "int", "strategy": "channel"}"#),
                "8-bit int weights",
            ),
            (
                ct(r#"{"num_bits": 8, "type": "float", "strategy": "group"}"#),
                "by 'group'",
            ),
        ];
        for (q, want) in cases {
            let e = config(&q).unwrap_err();
            assert!(e.contains(want) && !e.contains('\n'), "{want}: {e}");
        }
    }

    #[test]
    fn scales_by_tensor_row_and_block_dequantize_exactly() {
        let per_row = Fp8Checkpoint {
            scale_suffix: "_scale",
            block: None,
        };
        assert_eq!(
            per_row.scales(&[], vec![0.5], 2, 3).unwrap(),
            Fp8Scales::Rows(vec![0.5, 0.5])
        );
        assert_eq!(
            per_row.scales(&[2, 1], vec![0.5, 2.0], 2, 3).unwrap(),
            Fp8Scales::Rows(vec![0.5, 2.0])
        );
        assert!(per_row
            .scales(&[3], vec![1.0; 3], 2, 3)
            .unwrap_err()
            .contains("one per output row"));
        assert!(per_row
            .scales(&[1], vec![f32::NAN], 2, 3)
            .unwrap_err()
            .contains("not finite"));
        let blocks = Fp8Checkpoint {
            scale_suffix: "_scale_inv",
            block: Some((2, 2)),
        };
        // A 3x3 matrix in 2x2 blocks: a 2x2 grid with partial blocks at the edges.
        let s = blocks.scales(&[2, 2], vec![1.0, 2.0, 4.0, 8.0], 3, 3).unwrap();
        assert!(blocks
            .scales(&[1, 2], vec![1.0, 2.0], 3, 3)
            .unwrap_err()
            .contains("need [2, 2]"));
        let one = f32_to_e4m3(1.5);
        let bytes = [one; 9];
        let mut out = [0u8; 18];
        s.dequantize_to_bf16(&bytes, 3, &mut out);
        let got: Vec<f32> = out
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        assert_eq!(got, [1.5, 1.5, 3.0, 1.5, 1.5, 3.0, 6.0, 6.0, 12.0]);
    }

    #[test]
    fn a_row_re_encodes_to_its_bytes_through_bf16_with_its_scale() {
        // Every E4M3 magnitude times an awkward scale, rounded to bf16, encodes back to itself.
        let scale = 0.013_371_7f32;
        let bytes: Vec<u8> = (0..=0x7eu8).chain(0x80..=0xfe).collect();
        let values: Vec<f32> = bytes
            .iter()
            .map(|&b| bf16::from_f32(e4m3_to_f32(b) * scale).to_f32())
            .collect();
        let mut out = vec![0u8; bytes.len()];
        assert_eq!(encode_row(&values, Some(scale), &mut out), scale);
        let norm = |b: u8| if b == 0x80 { 0 } else { b };
        assert_eq!(
            out.iter().map(|&b| norm(b)).collect::<Vec<_>>(),
            bytes.iter().map(|&b| norm(b)).collect::<Vec<_>>()
        );
        // Without a scale the largest magnitude maps to 448 and every value is within half an
        // E4M3 step (2^-4 relative for normals, 2^-10 * scale below 2^-6 * scale).
        let row: Vec<f32> = (0..200).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        let s = encode_row(&row, None, &mut out[..200]);
        let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(s, amax / 448.0);
        for (&v, &q) in row.iter().zip(&out) {
            let back = e4m3_to_f32(q) * s;
            assert!(
                (back - v).abs() <= (v.abs() / 16.0).max(s / 1024.0) * 1.0001,
                "{v} -> {back}"
            );
        }
    }
}
