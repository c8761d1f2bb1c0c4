//! Where the model runs: `--device auto|cpu|cuda[:N]`, the GPU and multi-GPU flags, and starting
//! the engine there. `auto` and `cuda` plan over every visible GPU; `auto` says why it falls back to the CPU.

use clap::Args;
use strata_engine::{ActPrecision, EngineConfig, EngineHandle};
use strata_model::loader::LoadedModel;

/// A device choice from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    /// Every visible GPU, laid out by the planner (one GPU when it says so).
    Gpus,
    /// This one GPU.
    Cuda(usize),
}

/// Parses `auto`, `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "auto" => Ok(Device::Auto),
        "cpu" => Ok(Device::Cpu),
        "cuda" | "gpu" => Ok(Device::Gpus),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Device::Cuda(n)),
            _ => Err(format!("unknown device {s:?}; use auto, cpu, cuda or cuda:N")),
        },
    }
}

/// Device flags shared by `serve` and `run`.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Where to run: auto (the GPUs when usable, else the CPU), cpu, cuda (every visible GPU, as
    /// the planner lays them out) or cuda:N (that GPU only).
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: Device,
    /// GPUs per pipeline stage, each holding a slice of every layer's heads and MLP (vLLM's
    /// flag); default: the planner's choice.
    #[arg(long, visible_alias = "tp")]
    pub tensor_parallel_size: Option<usize>,
    /// Pipeline stages, each holding a range of layers (vLLM's flag); default: the planner's choice.
    #[arg(long, visible_alias = "pp")]
    pub pipeline_parallel_size: Option<usize>,
    /// Seconds a multi-GPU step may take before strata aborts the NCCL communicators and fails
    /// its requests with 503 instead of hanging (the first step gets 4x).
    #[arg(long, default_value_t = 30.0, value_parser = parse_seconds)]
    pub collective_timeout: f64,
    /// Plan with the machine saved in FILE (`strata topo --measure --save FILE`) instead of
    /// measuring the links at start.
    #[arg(long, value_name = "FILE")]
    pub topology: Option<std::path::PathBuf>,
    /// Fraction of GPU memory for weights, activations and KV cache together (GPU only).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Size every GPU as if it had only SIZE of memory (e.g. 24GiB: plan for, or emulate, a
    /// smaller card); --gpu-memory-utilization applies to the smaller of the two.
    #[arg(long, value_name = "SIZE", value_parser = crate::serve::parse_size)]
    pub gpu_memory_limit: Option<usize>,
    /// GPU weights: auto keeps a GGUF file's quantized matrices as they are (Q4_0, Q4_1, Q8_0,
    /// Q4_K, Q5_K, Q6_K; others are dequantized with a warning) and an FP8 checkpoint's as FP8,
    /// none dequantizes them to --dtype, fp8 converts every layer matrix to FP8 E4M3 with a scale
    /// per output channel while it loads (bfloat16 only).
    #[arg(long, default_value = "auto", value_parser = parse_quantization)]
    pub quantization: Quantization,
    /// Run every step eagerly: no CUDA graphs (GPU only; outputs are the same either way).
    #[arg(long)]
    pub enforce_eager: bool,
    /// Sum every GPU matrix product in one fixed order, so greedy output is the same token for
    /// token on one GPU, under tensor parallel and under pipeline parallel (slower; the CPU
    /// backend always sums in a fixed order).
    #[arg(long)]
    pub deterministic: bool,
    /// What the GPU computes in: auto (bfloat16 on a GPU, float32 on the CPU), bfloat16, or
    /// float32 (one GPU; weights, activations and KV cache in f32: twice the memory, much slower,
    /// and rounded like a float32 framework, for checking outputs).
    #[arg(long, value_enum, default_value_t = DtypeArg::Auto)]
    pub dtype: DtypeArg,
    /// Activation precision of the quantized decode path (the CPU's, and the GPU's GGUF
    /// matrices): standard (8-bit like llama.cpp) or high (~14-bit: greedy text matches a float
    /// reference; half the CPU's many-user throughput).
    #[arg(long, default_value = "standard", value_parser = ActPrecision::parse)]
    pub activation_precision: ActPrecision,
    /// Kernels left out of every GPU step (`bench-gpu --ablate`; not a flag of serve or run).
    #[arg(skip)]
    pub ablate: Vec<String>,
}

/// `--quantization` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Quantization {
    #[default]
    Auto,
    None,
    Fp8,
}

pub fn parse_quantization(s: &str) -> Result<Quantization, String> {
    match s {
        "auto" => Ok(Quantization::Auto),
        "none" => Ok(Quantization::None),
        "fp8" => Ok(Quantization::Fp8),
        other => Err(format!(
            "unknown --quantization {other:?}: auto keeps a GGUF file's quantized matrices (and an FP8 checkpoint's) as they are on the GPU, none dequantizes them to --dtype, fp8 converts the layer matrices to FP8 E4M3"
        )),
    }
}

/// `--dtype` values (vLLM's names, with short aliases).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtypeArg {
    Auto,
    #[value(alias = "bf16")]
    Bfloat16,
    #[value(alias = "f32", alias = "float")]
    Float32,
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("{s:?} is not a positive number of seconds, e.g. 30")),
    }
}

impl Default for DeviceArgs {
    fn default() -> Self {
        DeviceArgs {
            device: Device::Auto,
            tensor_parallel_size: None,
            pipeline_parallel_size: None,
            collective_timeout: 30.0,
            topology: None,
            gpu_memory_utilization: 0.9,
            gpu_memory_limit: None,
            quantization: Quantization::Auto,
            enforce_eager: false,
            deterministic: false,
            dtype: DtypeArg::Auto,
            activation_precision: ActPrecision::default(),
            ablate: Vec::new(),
        }
    }
}

impl DeviceArgs {
    /// What a GPU computes in under --dtype (auto is bf16 there).
    #[cfg(feature = "cuda")]
    pub fn compute_dtype(&self) -> strata_model::ComputeDtype {
        match self.dtype {
            DtypeArg::Auto | DtypeArg::Bfloat16 => strata_model::ComputeDtype::Bf16,
            DtypeArg::Float32 => strata_model::ComputeDtype::F32,
        }
    }

    /// GPUs asked for by --tensor-parallel-size x --pipeline-parallel-size (1 when not given).
    fn forced_gpus(&self) -> usize {
        self.tensor_parallel_size.unwrap_or(1) * self.pipeline_parallel_size.unwrap_or(1)
    }

    /// The GPU-only flags given that the CPU backend does not use (it runs the file's own weight
    /// types, has no CUDA graphs and always sums in a fixed order).
    fn unused_on_cpu(&self) -> Vec<&'static str> {
        [
            (self.quantization != Quantization::Auto, "--quantization"),
            (self.gpu_memory_limit.is_some(), "--gpu-memory-limit"),
            (self.enforce_eager, "--enforce-eager"),
            (self.tensor_parallel_size.is_some(), "--tensor-parallel-size"),
            (self.pipeline_parallel_size.is_some(), "--pipeline-parallel-size"),
            (self.topology.is_some(), "--topology"),
        ]
        .into_iter()
        .filter_map(|(given, flag)| given.then_some(flag))
        .collect()
    }
}

/// Whether the GPU would be tried (so the CUDA libraries must be found before threads start).
pub fn wants_gpu(d: Device) -> bool {
    d != Device::Cpu && cfg!(feature = "cuda")
}

/// Makes the CUDA libraries loadable (re-executing once with the library path set when needed).
/// Call before any thread starts.
pub fn prepare_libraries(d: Device) {
    #[cfg(feature = "cuda")]
    if wants_gpu(d) {
        let _ = strata_runtime::cuda::libraries::prepare();
    }
    #[cfg(not(feature = "cuda"))]
    let _ = d;
}

/// Step sizes left to the device's defaults when not given on the command line.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepFlags {
    /// `--max-num-seqs`: default 64 on the CPU, 256 on a GPU.
    pub max_num_seqs: Option<usize>,
    /// `--max-num-batched-tokens`: default 512 on the CPU, 2048 on a GPU.
    pub max_num_batched_tokens: Option<usize>,
}

impl StepFlags {
    fn apply(&self, config: &mut EngineConfig, gpu: bool) {
        config.max_num_seqs = self.max_num_seqs.unwrap_or(if gpu { 256 } else { 64 });
        config.max_num_batched_tokens = self.max_num_batched_tokens.unwrap_or(if gpu { 2048 } else { 512 });
    }
}

/// Starts the engine for `model` on the chosen device, with `draft` proposing tokens for it on
/// the same device when given (draft-model speculation, `config.speculative_model`).
pub fn start_engine(
    model: LoadedModel,
    draft: Option<LoadedModel>,
    config: EngineConfig,
    dev: &DeviceArgs,
    steps: StepFlags,
) -> anyhow::Result<EngineHandle> {
    match dev.device {
        Device::Cpu => start_cpu(model, draft, config, dev, steps),
        Device::Auto | Device::Gpus | Device::Cuda(_) => start_gpu_or_cpu(model, draft, config, dev, steps),
    }
}

/// The CPU engine with the CPU's step defaults.
fn start_cpu(
    model: LoadedModel,
    draft: Option<LoadedModel>,
    mut config: EngineConfig,
    dev: &DeviceArgs,
    steps: StepFlags,
) -> anyhow::Result<EngineHandle> {
    if dev.dtype == DtypeArg::Bfloat16 {
        anyhow::bail!("the CPU backend computes in float32; drop --dtype bfloat16 (or use --device cuda)");
    }
    let unused = dev.unused_on_cpu();
    if !unused.is_empty() {
        tracing::warn!(
            "{} applies to GPUs only; the CPU backend runs without it (pass --device cuda to use the GPU)",
            unused.join(", ")
        );
    }
    steps.apply(&mut config, false);
    config.activation_precision = dev.activation_precision;
    Ok(EngineHandle::start_with_draft_model(model, draft, config)?)
}

#[cfg(not(feature = "cuda"))]
fn start_gpu_or_cpu(
    model: LoadedModel,
    draft: Option<LoadedModel>,
    config: EngineConfig,
    dev: &DeviceArgs,
    steps: StepFlags,
) -> anyhow::Result<EngineHandle> {
    if matches!(dev.device, Device::Cuda(_) | Device::Gpus) {
        anyhow::bail!(
            "this strata was built without the `cuda` feature; rebuild with --features cuda or pass --device cpu"
        );
    }
    start_cpu(model, draft, config, dev, steps)
}

#[cfg(feature = "cuda")]
fn start_gpu_or_cpu(
    model: LoadedModel,
    draft: Option<LoadedModel>,
    mut config: EngineConfig,
    dev: &DeviceArgs,
    steps: StepFlags,
) -> anyhow::Result<EngineHandle> {
    use strata_runtime::cuda::{libraries, CudaError, Gpu};

    let libs = libraries::search(&libraries::candidate_dirs());
    let count = Gpu::count(&libs);
    // `auto` uses the GPU only when one answers; `cuda` insists.
    if dev.device == Device::Auto {
        let why = match &count {
            Ok(0) => Some("no CUDA GPU found".to_string()),
            Ok(_) => None,
            Err(CudaError::NoDevice(why)) => Some(why.clone()),
            Err(e) => {
                tracing::warn!("{e}");
                Some(e.to_string())
            }
        };
        if let Some(why) = why {
            tracing::info!("running on the CPU: {why}");
            return start_cpu(model, draft, config, dev, steps);
        }
    }
    steps.apply(&mut config, true);
    let ordinal = match dev.device {
        Device::Cuda(ordinal) => {
            if dev.forced_gpus() > 1 {
                anyhow::bail!(
                    "--device cuda:{ordinal} runs on that one GPU; use --device cuda with --tensor-parallel-size / --pipeline-parallel-size"
                );
            }
            ordinal
        }
        _ if count.unwrap_or(0) > 1 || dev.forced_gpus() > 1 => {
            if draft.is_some() {
                anyhow::bail!(
                    "--speculative-model runs beside a target on one GPU; pass --device cuda:N (or --speculative-ngram)"
                );
            }
            return Ok(start_planned(model, config, dev)?.0);
        }
        _ => 0,
    };
    match draft {
        Some(draft) => start_gpu_with_draft(model, draft, config, ordinal, dev),
        None => Ok(start_gpu(model, config, ordinal, dev)?.0),
    }
}

/// The GPU options of `config` and `dev` for GPU `ordinal`.
#[cfg(feature = "cuda")]
fn gpu_options(
    model: &LoadedModel,
    config: &EngineConfig,
    ordinal: usize,
    dev: &DeviceArgs,
) -> strata_model::cuda::GpuOptions {
    strata_model::cuda::GpuOptions {
        ordinal,
        gpu_memory_utilization: dev.gpu_memory_utilization,
        gpu_memory_limit: dev.gpu_memory_limit,
        quantization: match dev.quantization {
            Quantization::Auto => strata_model::cuda::GpuQuantization::Auto,
            Quantization::None => strata_model::cuda::GpuQuantization::None,
            Quantization::Fp8 => strata_model::cuda::GpuQuantization::Fp8,
        },
        dtype: dev.compute_dtype(),
        kv_cache_dtype: config.kv_cache_dtype,
        block_size: config.block_size,
        max_num_batched_tokens: config.max_num_batched_tokens,
        max_num_seqs: config.max_num_seqs,
        max_model_len: config.max_model_len.unwrap_or(model.transformer.config.max_position),
        enforce_eager: dev.enforce_eager,
        deterministic: dev.deterministic,
        ablate: dev.ablate.clone(),
        activation_precision: dev.activation_precision,
    }
}

/// Plans the model over the visible GPUs (printing the plan and why), and starts the engine on
/// the chosen layout: one GPU, or TP/PP workers. Also returns the bytes of the weight matrices.
#[cfg(feature = "cuda")]
pub fn start_planned(
    model: LoadedModel,
    config: EngineConfig,
    dev: &DeviceArgs,
) -> anyhow::Result<(EngineHandle, u64)> {
    use strata_parallel::ParallelExecutor;
    use strata_runtime::cuda::libraries;

    let max_model_len = config.max_model_len.unwrap_or(model.transformer.config.max_position);
    let layout = crate::plan::serving_layout(&model, max_model_len, config.max_num_seqs, config.kv_cache_dtype, dev)?;
    if layout.gpus.len() == 1 {
        return start_gpu(model, config, layout.gpus[0], dev);
    }
    let libs = libraries::search(&libraries::candidate_dirs());
    let opts = gpu_options(&model, &config, 0, dev);
    let timeout = std::time::Duration::from_secs_f64(dev.collective_timeout);
    start_uploaded(model, config, "uploading to the GPUs", |transformer, progress| {
        let executor = ParallelExecutor::new(transformer, layout, &opts, timeout, &libs, progress)?;
        let weight_bytes = executor.weight_bytes();
        Ok((Box::new(executor), weight_bytes))
    })
}

/// Uploads `model`'s weights with `upload` (under a progress bar titled `what`) and starts the
/// engine on the executor it makes; also returns the bytes of the weight matrices.
#[cfg(feature = "cuda")]
fn start_uploaded(
    model: LoadedModel,
    config: EngineConfig,
    what: &str,
    upload: impl FnOnce(
        strata_model::Transformer,
        &dyn Fn(u64, u64),
    ) -> Result<(Box<dyn strata_model::Executor>, u64), strata_model::ModelError>,
) -> anyhow::Result<(EngineHandle, u64)> {
    let LoadedModel {
        transformer,
        tokenizer,
        chat_template,
        ..
    } = model;
    let progress = crate::progress::bar(what);
    let (executor, weight_bytes) = upload(transformer, &|d, t| progress.update(d, t))?;
    progress.finish();
    let engine = EngineHandle::start_with(executor, tokenizer, chat_template, config)?;
    Ok((engine, weight_bytes))
}

/// Starts the engine for `model` on GPU `ordinal` with `config`'s step sizes; also returns the
/// bytes of the weight matrices (what one decode step reads).
#[cfg(feature = "cuda")]
pub fn start_gpu(
    model: LoadedModel,
    config: EngineConfig,
    ordinal: usize,
    dev: &DeviceArgs,
) -> anyhow::Result<(EngineHandle, u64)> {
    use strata_model::cuda::GpuExecutor;
    use strata_runtime::cuda::libraries;

    let libs = libraries::search(&libraries::candidate_dirs());
    let opts = gpu_options(&model, &config, ordinal, dev);
    start_uploaded(model, config, "uploading to the GPU", |transformer, progress| {
        let executor = GpuExecutor::new(transformer, &opts, &libs, progress)?;
        let weight_bytes = executor.weight_bytes();
        Ok((Box::new(executor), weight_bytes))
    })
}

/// Starts the engine for `model` on GPU `ordinal` with `draft` proposing tokens on the same GPU.
/// The draft is uploaded first, on its weights' share of --gpu-memory-utilization (at least a
/// twentieth of it) for its weights, activations and KV cache; the target gets the rest. The
/// draft keeps its file's weight format (`--quantization` is the target's): a draft is meant to be
/// cheap, e.g. a 4-bit GGUF drafting for a bf16 or FP8 target.
#[cfg(feature = "cuda")]
fn start_gpu_with_draft(
    model: LoadedModel,
    draft: LoadedModel,
    config: EngineConfig,
    ordinal: usize,
    dev: &DeviceArgs,
) -> anyhow::Result<EngineHandle> {
    use strata_model::cuda::GpuExecutor;
    use strata_runtime::cuda::libraries;

    let libs = libraries::search(&libraries::candidate_dirs());
    let util = dev.gpu_memory_utilization;
    let (target_bytes, draft_bytes) = (
        model.transformer.weights.matrix_bytes(),
        draft.transformer.weights.matrix_bytes(),
    );
    let draft_share = (util * draft_bytes as f64 / (target_bytes + draft_bytes).max(1) as f64).max(util / 20.0);
    let draft_opts = strata_model::cuda::GpuOptions {
        gpu_memory_utilization: draft_share,
        quantization: strata_model::cuda::GpuQuantization::Auto,
        ..gpu_options(&draft, &config, ordinal, dev)
    };
    let target_opts = strata_model::cuda::GpuOptions {
        gpu_memory_utilization: util - draft_share,
        ..gpu_options(&model, &config, ordinal, dev)
    };
    let progress = crate::progress::bar("uploading the draft model to the GPU");
    let draft_executor = GpuExecutor::new(draft.transformer, &draft_opts, &libs, &|d, t| progress.update(d, t))?;
    progress.finish();
    let draft = strata_engine::DraftModel {
        executor: Box::new(draft_executor),
        tokenizer: draft.tokenizer,
    };
    let LoadedModel {
        transformer,
        tokenizer,
        chat_template,
        ..
    } = model;
    let progress = crate::progress::bar("uploading to the GPU");
    let executor = GpuExecutor::new(transformer, &target_opts, &libs, &|d, t| progress.update(d, t))?;
    progress.finish();
    Ok(EngineHandle::start_with_draft(
        Box::new(executor),
        Some(draft),
        tokenizer,
        chat_template,
        config,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_to_one_gpu_or_the_planned_set() {
        assert_eq!(parse_device("cuda"), Ok(Device::Gpus));
        assert_eq!(parse_device("GPU"), Ok(Device::Gpus));
        assert_eq!(parse_device("cuda:1"), Ok(Device::Cuda(1)));
        assert_eq!(parse_device("auto"), Ok(Device::Auto));
        assert!(parse_device("cuda:x").unwrap_err().contains("cuda:N"));
        assert_eq!(parse_quantization("fp8"), Ok(Quantization::Fp8));
        assert!(parse_quantization("awq").unwrap_err().contains("fp8 converts"));
        assert_eq!(parse_seconds("2.5"), Ok(2.5));
        assert!(parse_seconds("-1").is_err() && parse_seconds("inf").is_err());
    }

    #[test]
    fn forced_layouts_count_their_gpus() {
        let dev = DeviceArgs {
            tensor_parallel_size: Some(2),
            pipeline_parallel_size: Some(2),
            ..Default::default()
        };
        assert_eq!(dev.forced_gpus(), 4);
        assert_eq!(DeviceArgs::default().forced_gpus(), 1);
        // The CPU backend names the GPU-only flags it was given and will not use.
        assert_eq!(
            dev.unused_on_cpu(),
            ["--tensor-parallel-size", "--pipeline-parallel-size"]
        );
        let dev = DeviceArgs {
            quantization: Quantization::Fp8,
            enforce_eager: true,
            gpu_memory_limit: Some(1 << 30),
            ..Default::default()
        };
        assert_eq!(
            dev.unused_on_cpu(),
            ["--quantization", "--gpu-memory-limit", "--enforce-eager"]
        );
        assert!(DeviceArgs::default().unused_on_cpu().is_empty());
    }
}
