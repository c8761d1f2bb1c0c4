//! `strata quantize`: re-quantizes a GGUF model's weight matrices to one GGML type or the Q4_K_M mix.
//! Streams tensor by tensor (memory is about one tensor), keeps all metadata, writes via a temporary name.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use clap::Args;
use strata_formats::gguf::{GgufFile, GgufWriter, MetaValue, TensorInfo};
use strata_formats::quant::{dequantize, quantize};
use strata_formats::GgmlType;
use strata_model::hf_checkpoint::is_hf_checkpoint;
use strata_model::loader::open_gguf;
use strata_model::weights::Role;

use crate::progress::bar;
use crate::random_weights::RandomModel;

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// The GGUF model to read (tensors of any type strata dequantizes).
    pub input: PathBuf,
    /// The GGUF file to write; it appears only once complete.
    pub output: PathBuf,
    /// Q4_K_M (llama.cpp's mix: Q6_K for the LM head and half of attn_v/ffn_down, Q4_K for the
    /// rest), or one type for the matrices: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16,
    /// F32 (the LM head of the 4- and 5-bit types in Q6_K, as llama.cpp does).
    #[arg(long = "type", value_name = "TYPE")]
    pub target: String,
    /// Threads (default: all cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Write random weights in the shape this checkpoint's config.json gives (the file or its
    /// directory) instead of the input's tensors; the input gives the tokenizer and chat template.
    #[arg(long, value_name = "CONFIG_JSON")]
    pub random_weights: Option<PathBuf>,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// What the matrices become.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    /// Every matrix in this type, but the LM head in Q6_K where the type has fewer bits (as
    /// llama.cpp's `llama-quantize` does for Q4_0 ... Q5_K_S).
    Uniform(GgmlType),
    /// llama.cpp's Q4_K_M: Q6_K for the LM head (the embedding when tied) and for attn_v and
    /// ffn_down in about half the layers (the first and last eighth, every third between), Q4_K else.
    Q4KM,
}

/// The names `--type` accepts, with the recipe and the `general.file_type` (llama.cpp's ftype) each writes.
const RECIPES: [(&str, Recipe, u32); 12] = [
    ("Q4_K_M", Recipe::Q4KM, 15),
    ("Q4_K", Recipe::Uniform(GgmlType::Q4K), 14),
    ("Q5_K", Recipe::Uniform(GgmlType::Q5K), 16),
    ("Q6_K", Recipe::Uniform(GgmlType::Q6K), 18),
    ("Q8_0", Recipe::Uniform(GgmlType::Q8_0), 7),
    ("Q4_0", Recipe::Uniform(GgmlType::Q4_0), 2),
    ("Q4_1", Recipe::Uniform(GgmlType::Q4_1), 3),
    ("Q5_0", Recipe::Uniform(GgmlType::Q5_0), 8),
    ("Q5_1", Recipe::Uniform(GgmlType::Q5_1), 9),
    ("F16", Recipe::Uniform(GgmlType::F16), 1),
    ("BF16", Recipe::Uniform(GgmlType::BF16), 32),
    ("F32", Recipe::Uniform(GgmlType::F32), 0),
];

/// The quantization version llama.cpp writes for the current block layouts.
const QUANTIZATION_VERSION: u32 = 2;

impl Recipe {
    /// The recipe `--type` names (case-insensitive) and its `general.file_type`.
    pub fn parse(name: &str) -> anyhow::Result<(Recipe, u32)> {
        RECIPES
            .iter()
            .find(|(n, _, _)| n.eq_ignore_ascii_case(name))
            .map(|&(_, recipe, file_type)| (recipe, file_type))
            .ok_or_else(|| {
                let names: Vec<&str> = RECIPES.iter().map(|(n, _, _)| *n).collect();
                anyhow!("unknown --type {name:?}; pass one of {}", names.join(", "))
            })
    }

    /// The type the matrix `name` gets, before the block-size check.
    fn matrix_type(self, name: &str, n_layers: usize, has_output: bool) -> GgmlType {
        let lm_head = if has_output {
            Role::Output.gguf_name(0)
        } else {
            Role::TokenEmbd.gguf_name(0)
        };
        match self {
            Recipe::Uniform(ty) => {
                use GgmlType::*;
                let few_bits = matches!(ty, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4K | Q5K);
                if name == lm_head && few_bits {
                    Q6K
                } else {
                    ty
                }
            }
            Recipe::Q4KM => {
                let layer = Role::layer_of(name, false);
                let more_bits = layer.is_some_and(|l| {
                    (name == Role::V.gguf_name(l) || name == Role::Down.gguf_name(l)) && use_more_bits(l, n_layers)
                });
                if name == lm_head || more_bits {
                    GgmlType::Q6K
                } else {
                    GgmlType::Q4K
                }
            }
        }
    }
}

/// llama.cpp's choice of the layers that keep more bits in its _M mixes: the first and last
/// eighth, and every third layer between.
fn use_more_bits(layer: usize, n_layers: usize) -> bool {
    let eighth = n_layers / 8;
    layer < eighth || layer >= 7 * n_layers / 8 || (layer - eighth) % 3 == 2
}

/// What one tensor becomes, and why when it is not what the recipe asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlan {
    pub ty: GgmlType,
    /// Set when the tensor's rows do not fill whole blocks of the recipe's type.
    pub fallback_from: Option<GgmlType>,
}

/// The type each tensor of `tensors` is written as: vectors (norms, biases) as F32, matrices
/// as the recipe says, falling back to Q8_0 (else F32) where a row is not whole blocks; tensors
/// strata cannot decode keep their type and bytes.
pub fn plan_tensors(tensors: &[TensorInfo], recipe: Recipe) -> Vec<TensorPlan> {
    let n_layers = tensors
        .iter()
        .filter_map(|t| Role::layer_of(&t.name, false))
        .max()
        .map_or(0, |l| l + 1);
    let has_output = tensors.iter().any(|t| t.name == Role::Output.gguf_name(0));
    tensors
        .iter()
        .map(|t| {
            if !t.ty.can_dequantize() {
                return TensorPlan {
                    ty: t.ty,
                    fallback_from: None,
                };
            }
            if t.dims.len() < 2 {
                return TensorPlan {
                    ty: GgmlType::F32,
                    fallback_from: None,
                };
            }
            let wanted = recipe.matrix_type(&t.name, n_layers, has_output);
            let fits = |ty: GgmlType| t.row_len().is_multiple_of(ty.block_len() as u64);
            if fits(wanted) {
                return TensorPlan {
                    ty: wanted,
                    fallback_from: None,
                };
            }
            let ty = if fits(GgmlType::Q8_0) {
                GgmlType::Q8_0
            } else {
                GgmlType::F32
            };
            TensorPlan {
                ty,
                fallback_from: Some(wanted),
            }
        })
        .collect()
}

pub fn quantize_command(args: QuantizeArgs) -> anyhow::Result<()> {
    let (recipe, file_type) = Recipe::parse(&args.target)?;
    if is_hf_checkpoint(&args.input) && args.input.exists() {
        bail!(
            "{} is an HF checkpoint; strata quantize reads GGUF files: convert it first (llama.cpp's \
             convert_hf_to_gguf.py --outtype bf16) and quantize the .gguf",
            args.input.display()
        );
    }
    let file = open_gguf(&args.input)?;
    if same_file(&args.input, &args.output) {
        bail!(
            "{} is the input file; pass a different output path",
            args.output.display()
        );
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let start = Instant::now();
    let random = args
        .random_weights
        .as_deref()
        .map(|config| RandomModel::new(config, &file, args.seed))
        .transpose()?;
    let tensors = match &random {
        Some(model) => model.tensors(),
        None => file.tensors().to_vec(),
    };
    let plans = plan_tensors(&tensors, recipe);
    print_fallbacks(&tensors, &plans);

    let writer = build_writer(&file, random.as_ref(), &tensors, &plans, file_type)?;
    let partial = partial_path(&args.output);
    let source = Source {
        file: &file,
        random: random.as_ref(),
        tensors: &tensors,
        plans: &plans,
    };
    let result = source.write(&writer, &partial, threads);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    std::fs::rename(&partial, &args.output)
        .with_context(|| format!("cannot rename {} to {}", partial.display(), args.output.display()))?;

    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for p in &plans {
        *counts.entry(p.ty.name()).or_default() += 1;
    }
    let counts: Vec<String> = counts.iter().map(|(ty, n)| format!("{n} {ty}")).collect();
    eprintln!(
        "wrote {}: {} tensors ({}), {:.1} MiB, in {:.1} s",
        args.output.display(),
        plans.len(),
        counts.join(", "),
        writer.layout().total_len as f64 / (1 << 20) as f64,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One line per (row length, wanted type) that fell back, naming the tensors (layer numbers as `*`).
fn print_fallbacks(tensors: &[TensorInfo], plans: &[TensorPlan]) {
    let mut groups: BTreeMap<(u64, &str, usize, &str), Vec<String>> = BTreeMap::new();
    for (t, p) in tensors.iter().zip(plans) {
        let Some(wanted) = p.fallback_from else { continue };
        let name = match Role::layer_of(&t.name, false) {
            Some(l) => t.name.replacen(&format!("blk.{l}."), "blk.*.", 1),
            None => t.name.clone(),
        };
        let key = (t.row_len(), wanted.name(), wanted.block_len(), p.ty.name());
        let names = groups.entry(key).or_default();
        if !names.contains(&name) {
            names.push(name);
        }
    }
    for ((row_len, wanted, block_len, ty), names) in groups {
        eprintln!(
            "note: {}: rows of {row_len} values are not whole {wanted} blocks of {block_len}; written as {ty}",
            names.join(", ")
        );
    }
}

/// A writer holding the input's metadata (file type updated; with random weights, the
/// hyper-parameters of their shape) and every tensor declared.
fn build_writer(
    file: &GgufFile,
    random: Option<&RandomModel>,
    tensors: &[TensorInfo],
    plans: &[TensorPlan],
    file_type: u32,
) -> anyhow::Result<GgufWriter> {
    let mut writer = GgufWriter::with_version(file.version.max(2))?;
    let hparams_prefix = random.map(|r| format!("{}.", r.config.arch.name));
    for (key, value) in file.metadata() {
        if hparams_prefix.as_ref().is_some_and(|p| key.starts_with(p.as_str())) {
            continue;
        }
        writer.add_metadata(key.clone(), value.clone())?;
    }
    for (key, value) in random.map(RandomModel::hparams).unwrap_or_default() {
        writer.add_metadata(key, value)?;
    }
    writer.set_metadata("general.file_type", MetaValue::U32(file_type))?;
    if plans.iter().any(|p| p.ty.is_quantized()) {
        writer.set_metadata("general.quantization_version", MetaValue::U32(QUANTIZATION_VERSION))?;
    }
    for (t, p) in tensors.iter().zip(plans) {
        writer.add_tensor_info(t.name.clone(), &t.dims, p.ty)?;
    }
    Ok(writer)
}

/// Where the written tensors' values come from: the input file's tensors, or random weights.
struct Source<'a> {
    file: &'a GgufFile,
    random: Option<&'a RandomModel>,
    tensors: &'a [TensorInfo],
    plans: &'a [TensorPlan],
}

impl Source<'_> {
    /// Writes the file at `path`, tensor by tensor.
    fn write(&self, writer: &GgufWriter, path: &Path, threads: usize) -> anyhow::Result<()> {
        let out = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, out);
        let total: u64 = self.tensors.iter().map(|t| t.n_elements).sum();
        let progress = bar("quantizing");
        let mut done = 0u64;
        writer.write_streaming(&mut out, |i| {
            let t = &self.tensors[i];
            let bytes = self
                .tensor_bytes(t, self.plans[i].ty, threads)
                .with_context(|| format!("tensor {}", t.name))?;
            done += t.n_elements;
            progress.update(done, total);
            Ok::<_, anyhow::Error>(bytes)
        })?;
        progress.finish();
        out.into_inner().map_err(|e| e.into_error())?;
        Ok(())
    }

    /// The bytes of tensor `t` as type `to`.
    fn tensor_bytes(&self, t: &TensorInfo, to: GgmlType, threads: usize) -> anyhow::Result<Vec<u8>> {
        let row_len = t.row_len() as usize;
        match self.random {
            Some(model) => encode_rows(t.n_rows() as usize, row_len, to, threads, |row, values| {
                model.fill_row(&t.name, row, values);
                Ok(())
            }),
            None => convert(t.ty, self.file.tensor_data(t), row_len, to, threads),
        }
    }
}

/// `src` (rows of `row_len` values of type `from`) as type `to`, rows spread over `threads`
/// threads. Bytes are copied unchanged when the types are equal. The result does not depend on
/// the thread count: each row is converted on its own.
pub fn convert(from: GgmlType, src: &[u8], row_len: usize, to: GgmlType, threads: usize) -> anyhow::Result<Vec<u8>> {
    if from == to {
        return Ok(src.to_vec());
    }
    let src_row = from
        .bytes_for(row_len as u64)
        .ok_or_else(|| anyhow!("rows of {row_len} {from} values"))? as usize;
    if src_row == 0 || !src.len().is_multiple_of(src_row) {
        bail!("{} bytes are not whole rows of {row_len} {from} values", src.len());
    }
    encode_rows(src.len() / src_row, row_len, to, threads, |row, values| {
        Ok(dequantize(from, &src[row * src_row..(row + 1) * src_row], values)?)
    })
}

/// `n_rows` rows of `row_len` values, each made by `fill(row, values)`, encoded as type `to`;
/// rows are spread over `threads` threads, and the result does not depend on how many.
pub fn encode_rows(
    n_rows: usize,
    row_len: usize,
    to: GgmlType,
    threads: usize,
    fill: impl Fn(usize, &mut [f32]) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<Vec<u8>> {
    let dst_row = to
        .bytes_for(row_len as u64)
        .ok_or_else(|| anyhow!("rows of {row_len} {to} values"))? as usize;
    let mut out = vec![0u8; n_rows * dst_row];
    let rows_per_task = n_rows.div_ceil(threads).max(1);
    let fill = &fill;
    std::thread::scope(|scope| {
        let tasks: Vec<_> = out
            .chunks_mut(rows_per_task * dst_row)
            .enumerate()
            .map(|(task, dst)| {
                scope.spawn(move || {
                    let mut values = vec![0.0f32; row_len];
                    for (row, d) in (task * rows_per_task..).zip(dst.chunks_exact_mut(dst_row)) {
                        fill(row, &mut values).with_context(|| format!("row {row}"))?;
                        quantize(to, &values, d).with_context(|| format!("row {row}"))?;
                    }
                    Ok::<(), anyhow::Error>(())
                })
            })
            .collect();
        tasks
            .into_iter()
            .try_for_each(|t| t.join().map_err(|_| anyhow!("a quantizing thread panicked"))?)
    })?;
    Ok(out)
}

/// `OUT.partial` beside `OUT`: where the file is written until it is complete.
fn partial_path(output: &Path) -> PathBuf {
    let mut name = output.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    output.with_file_name(name)
}

/// Whether `a` and `b` name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, dims: &[u64], ty: GgmlType) -> TensorInfo {
        let n_elements = dims.iter().product();
        TensorInfo {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            offset: 0,
            n_elements,
            n_bytes: ty.bytes_for(n_elements).unwrap_or(0),
        }
    }

    #[test]
    fn more_bits_follow_llama_cpp_for_32_layers() {
        let chosen: Vec<usize> = (0..32).filter(|&l| use_more_bits(l, 32)).collect();
        assert_eq!(chosen, [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]);
    }

    #[test]
    fn q4_k_m_gives_the_lm_head_and_chosen_layers_q6_k() {
        let mut tensors = vec![
            info("token_embd.weight", &[512, 1000], GgmlType::F16),
            info("output.weight", &[512, 1000], GgmlType::F16),
            info("output_norm.weight", &[512], GgmlType::F32),
        ];
        for l in 0..8 {
            for name in ["attn_q", "attn_v", "ffn_down"] {
                tensors.push(info(&format!("blk.{l}.{name}.weight"), &[512, 512], GgmlType::BF16));
            }
        }
        let plans = plan_tensors(&tensors, Recipe::Q4KM);
        let ty_of = |name: &str| plans[tensors.iter().position(|t| t.name == name).unwrap()].ty;
        assert_eq!(ty_of("token_embd.weight"), GgmlType::Q4K);
        assert_eq!(ty_of("output.weight"), GgmlType::Q6K);
        assert_eq!(ty_of("output_norm.weight"), GgmlType::F32);
        assert_eq!(ty_of("blk.0.attn_v.weight"), GgmlType::Q6K);
        assert_eq!(ty_of("blk.0.attn_q.weight"), GgmlType::Q4K);
        assert_eq!(ty_of("blk.3.ffn_down.weight"), GgmlType::Q6K);
        assert_eq!(ty_of("blk.4.ffn_down.weight"), GgmlType::Q4K);
        assert_eq!(ty_of("blk.7.attn_v.weight"), GgmlType::Q6K);

        // Tied embeddings: the embedding is the LM head.
        let plans = plan_tensors(&tensors[..1], Recipe::Q4KM);
        assert_eq!(plans[0].ty, GgmlType::Q6K);
    }

    #[test]
    fn few_bit_types_give_the_lm_head_q6_k() {
        let tensors = [
            info("token_embd.weight", &[512, 1000], GgmlType::F16),
            info("output.weight", &[512, 1000], GgmlType::F16),
        ];
        for (ty, head) in [
            (GgmlType::Q4_0, GgmlType::Q6K),
            (GgmlType::Q5K, GgmlType::Q6K),
            (GgmlType::Q8_0, GgmlType::Q8_0),
            (GgmlType::BF16, GgmlType::BF16),
        ] {
            let types: Vec<GgmlType> = plan_tensors(&tensors, Recipe::Uniform(ty))
                .iter()
                .map(|p| p.ty)
                .collect();
            assert_eq!(types, [ty, head], "{ty}");
        }
    }

    #[test]
    fn rows_that_are_not_whole_blocks_fall_back() {
        let tensors = [
            info("blk.0.attn_q.weight", &[576, 576], GgmlType::Q4_1),
            info("blk.0.ffn_down.weight", &[1536, 576], GgmlType::Q4_1),
            info("odd.weight", &[100, 3], GgmlType::F32),
            info("ids", &[16], GgmlType::I32),
        ];
        let plans = plan_tensors(&tensors, Recipe::Uniform(GgmlType::Q4K));
        let types: Vec<GgmlType> = plans.iter().map(|p| p.ty).collect();
        assert_eq!(types, [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::F32, GgmlType::I32]);
        assert_eq!(plans[0].fallback_from, Some(GgmlType::Q4K));
        assert_eq!(plans[1].fallback_from, None);
    }

    #[test]
    fn conversion_does_not_depend_on_the_thread_count() {
        let values: Vec<f32> = (0..256 * 7).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let src: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let one = convert(GgmlType::F32, &src, 256, GgmlType::Q4K, 1).unwrap();
        for threads in [2, 3, 16] {
            assert_eq!(convert(GgmlType::F32, &src, 256, GgmlType::Q4K, threads).unwrap(), one);
        }
        assert_eq!(convert(GgmlType::Q4K, &one, 256, GgmlType::Q4K, 2).unwrap(), one);
    }

    #[test]
    fn unknown_types_name_the_choices() {
        assert_eq!(Recipe::parse("q4_k_m").unwrap(), (Recipe::Q4KM, 15));
        let err = Recipe::parse("Q3_K").unwrap_err().to_string();
        assert!(err.contains("Q4_K_M") && err.contains("Q8_0"), "{err}");
    }
}
