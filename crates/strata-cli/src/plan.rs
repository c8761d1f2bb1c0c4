//! `strata plan`: how a model would be spread over this machine's GPUs (TP, PP, layer ranges) and
//! why, with vLLM's and llama.cpp's layout flags as overrides; and the plan `serve` starts with.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use strata_model::kv_cache::KvCacheDtype;
use strata_model::ComputeDtype;
use strata_parallel::{ModelShape, OverrideFlags, SplitMode, Targets};

use crate::topo::load_topology;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// A GGUF file, a Hugging Face folder or its config.json, or a preset: llama-3-8b, llama-3-70b, qwen2.5-7b, qwen2.5-32b.
    #[arg(long, short = 'm')]
    pub model: String,
    /// Plan for the machine saved in FILE (`strata topo --save FILE`) instead of this one.
    #[arg(long, value_name = "FILE")]
    pub topology: Option<PathBuf>,
    /// Longest prompt + output each sequence must hold.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(16..=1_048_576))]
    pub max_model_len: u32,
    /// Sequences that must fit in the KV cache at once at --max-model-len.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_num_seqs: u32,
    /// Fraction of each GPU's free memory strata may take.
    #[arg(long, default_value_t = 0.9, value_parser = parse_fraction)]
    pub gpu_memory_utilization: f64,
    /// KV cache element type: auto (bf16) or fp8 (e4m3, half the memory).
    #[arg(long, default_value = "auto", value_parser = KvCacheDtype::parse)]
    pub kv_cache_dtype: KvCacheDtype,
    /// Force the tensor parallel size (vLLM).
    #[arg(long, visible_alias = "tp")]
    pub tensor_parallel_size: Option<usize>,
    /// Force the pipeline parallel size (vLLM).
    #[arg(long, visible_alias = "pp")]
    pub pipeline_parallel_size: Option<usize>,
    /// Force llama.cpp's split: layer (pipeline), row (tensor parallel) or none (one GPU).
    #[arg(long, value_enum)]
    pub split_mode: Option<SplitModeArg>,
    /// llama.cpp's per-GPU shares of the layers, e.g. 3,1 (0 leaves a GPU out).
    #[arg(long, value_delimiter = ',', value_name = "SHARES")]
    pub tensor_split: Option<Vec<f64>>,
    /// The GPU for --split-mode none (llama.cpp).
    #[arg(long)]
    pub main_gpu: Option<usize>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum SplitModeArg {
    None,
    Layer,
    Row,
}

fn parse_fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!("{text:?} is not a fraction in (0, 1], e.g. 0.9")),
    }
}

pub fn plan(args: PlanArgs) -> anyhow::Result<()> {
    let model = ModelShape::resolve(&args.model).with_context(|| format!("--model {}", args.model))?;
    let topology = load_topology(args.topology.as_ref())?;
    let flags = OverrideFlags {
        tensor_parallel_size: args.tensor_parallel_size,
        pipeline_parallel_size: args.pipeline_parallel_size,
        split_mode: args.split_mode.map(|m| match m {
            SplitModeArg::None => SplitMode::None,
            SplitModeArg::Layer => SplitMode::Layer,
            SplitModeArg::Row => SplitMode::Row,
        }),
        tensor_split: args.tensor_split.clone(),
        main_gpu: args.main_gpu,
    };
    let forced = flags.layout(topology.gpus.len())?;
    let targets = Targets {
        max_model_len: args.max_model_len as usize,
        max_num_seqs: args.max_num_seqs as usize,
        gpu_memory_utilization: args.gpu_memory_utilization,
        kv_cache_dtype: args.kv_cache_dtype,
        // `strata plan` sizes the GPU backend's default, bf16.
        compute_dtype: ComputeDtype::Bf16,
    };
    let plan = strata_parallel::plan(&model, &topology, &targets, forced.as_ref())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", strata_parallel::plan_report::render(&plan, &topology));
    }
    Ok(())
}

/// The layout `serve` runs `model` with on this machine's GPUs: the planner's choice (or the
/// forced --tensor-parallel-size / --pipeline-parallel-size), printed with its reasons. The links
/// are measured first unless --topology names a saved machine. Sets the NCCL environment the plan
/// lists, where the user has not set it.
#[cfg(feature = "cuda")]
pub fn serving_layout(
    model: &strata_model::loader::LoadedModel,
    max_model_len: usize,
    max_num_seqs: usize,
    kv_dtype: KvCacheDtype,
    dev: &crate::device::DeviceArgs,
) -> anyhow::Result<strata_parallel::ParallelLayout> {
    let mut topology = load_topology(dev.topology.as_ref())?;
    if dev.topology.is_none() && topology.gpus.len() > 1 {
        crate::topo::measure(&mut topology)?;
    }
    let flags = OverrideFlags {
        tensor_parallel_size: dev.tensor_parallel_size,
        pipeline_parallel_size: dev.pipeline_parallel_size,
        ..Default::default()
    };
    let forced = flags.layout(topology.gpus.len())?;
    let targets = Targets {
        max_model_len,
        // Enough KV for a few full-length sequences; the executor gives the KV cache all the rest.
        max_num_seqs: max_num_seqs.min(4),
        gpu_memory_utilization: dev.gpu_memory_utilization,
        kv_cache_dtype: kv_dtype,
        compute_dtype: dev.compute_dtype(),
    };
    let shape = weights_on_gpus(model, dev.quantization)?;
    let plan = strata_parallel::plan(&shape, &topology, &targets, forced.as_ref())?;
    eprint!("{}", strata_parallel::plan_report::render(&plan, &topology));
    plan.set_nccl_env();
    Ok(plan.layout())
}

/// `model`'s weights as the GPU executors will hold them under `quantization`: a GGUF file's
/// blocks as quant.cu keeps them, FP8 layer matrices (`fp8`, or an FP8 checkpoint under `auto`),
/// or bf16.
#[cfg(feature = "cuda")]
fn weights_on_gpus(
    model: &strata_model::loader::LoadedModel,
    quantization: crate::device::Quantization,
) -> anyhow::Result<strata_parallel::ModelShape> {
    use crate::device::Quantization;
    use strata_parallel::ModelShape;

    let name = strata_model::loader::model_name(&model.path);
    let config = model.transformer.config.clone();
    let gguf = model.path.extension().is_some_and(|e| e == "gguf");
    Ok(match quantization {
        Quantization::None => ModelShape::dense(&name, "bf16", config, 16.0),
        Quantization::Fp8 => ModelShape::fp8_layers(&name, config),
        Quantization::Auto if gguf => ModelShape {
            name,
            ..ModelShape::from_gguf_on_gpu(&model.path)?
        },
        // An FP8 checkpoint's matrices came with their scales (weights.rs).
        Quantization::Auto
            if model
                .transformer
                .weights
                .layers
                .iter()
                .any(|l| l.wq.fp8_scales.is_some()) =>
        {
            ModelShape::fp8_layers(&name, config)
        }
        Quantization::Auto => ModelShape::dense(&name, "bf16", config, 16.0),
    })
}
