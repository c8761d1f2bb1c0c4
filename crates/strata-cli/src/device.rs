//! Where the model runs: `--device auto|cpu|cuda[:N]` and the GPU flags, and starting the engine
//! on that device. `auto` takes GPU 0 when one is usable and says why when it falls back to the CPU.

use clap::Args;
use strata_engine::{EngineConfig, EngineHandle};
use strata_model::loader::LoadedModel;

/// A device choice from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda(usize),
}

/// Parses `auto`, `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "auto" => Ok(Device::Auto),
        "cpu" => Ok(Device::Cpu),
        "cuda" | "gpu" => Ok(Device::Cuda(0)),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Device::Cuda(n)),
            _ => Err(format!("unknown device {s:?}; use auto, cpu, cuda or cuda:N")),
        },
    }
}

/// Device flags shared by `serve` and `run`.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Where to run: auto (GPU 0 when usable, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: Device,
    /// Fraction of GPU memory for weights, activations and KV cache together (GPU only).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Run every step eagerly: no CUDA graphs (GPU only; outputs are the same either way).
    #[arg(long)]
    pub enforce_eager: bool,
}

impl Default for DeviceArgs {
    fn default() -> Self {
        DeviceArgs {
            device: Device::Auto,
            gpu_memory_utilization: 0.9,
            enforce_eager: false,
        }
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

/// Starts the engine for `model` on the chosen device.
pub fn start_engine(
    model: LoadedModel,
    config: EngineConfig,
    dev: &DeviceArgs,
    steps: StepFlags,
) -> anyhow::Result<EngineHandle> {
    match dev.device {
        Device::Cpu => start_cpu(model, config, steps),
        Device::Auto | Device::Cuda(_) => start_gpu_or_cpu(model, config, dev, steps),
    }
}

/// The CPU engine with the CPU's step defaults.
fn start_cpu(model: LoadedModel, mut config: EngineConfig, steps: StepFlags) -> anyhow::Result<EngineHandle> {
    steps.apply(&mut config, false);
    Ok(EngineHandle::start(model, config)?)
}

#[cfg(not(feature = "cuda"))]
fn start_gpu_or_cpu(
    model: LoadedModel,
    config: EngineConfig,
    dev: &DeviceArgs,
    steps: StepFlags,
) -> anyhow::Result<EngineHandle> {
    if let Device::Cuda(_) = dev.device {
        anyhow::bail!(
            "this strata was built without the `cuda` feature; rebuild with --features cuda or pass --device cpu"
        );
    }
    start_cpu(model, config, steps)
}

#[cfg(feature = "cuda")]
fn start_gpu_or_cpu(
    model: LoadedModel,
    mut config: EngineConfig,
    dev: &DeviceArgs,
    steps: StepFlags,
) -> anyhow::Result<EngineHandle> {
    use strata_runtime::cuda::{libraries, CudaError, Gpu};

    let libs = libraries::search(&libraries::candidate_dirs());
    let ordinal = match dev.device {
        Device::Cuda(n) => n,
        _ => 0,
    };
    // `auto` uses the GPU only when one answers; `cuda` insists.
    if dev.device == Device::Auto {
        let why = match Gpu::count(&libs) {
            Ok(0) => Some("no CUDA GPU found".to_string()),
            Ok(_) => None,
            Err(CudaError::NoDevice(why)) => Some(why),
            Err(e) => {
                tracing::warn!("{e}");
                Some(e.to_string())
            }
        };
        if let Some(why) = why {
            tracing::info!("running on the CPU: {why}");
            return start_cpu(model, config, steps);
        }
    }
    steps.apply(&mut config, true);
    Ok(start_gpu(model, config, ordinal, dev)?.0)
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
    use strata_model::cuda::{GpuExecutor, GpuOptions};
    use strata_runtime::cuda::libraries;

    let libs = libraries::search(&libraries::candidate_dirs());
    let max_model_len = config.max_model_len.unwrap_or(model.transformer.config.max_position);
    let opts = GpuOptions {
        ordinal,
        gpu_memory_utilization: dev.gpu_memory_utilization,
        kv_cache_dtype: config.kv_cache_dtype,
        block_size: config.block_size,
        max_num_batched_tokens: config.max_num_batched_tokens,
        max_num_seqs: config.max_num_seqs,
        max_model_len,
        enforce_eager: dev.enforce_eager,
    };
    let LoadedModel {
        transformer,
        tokenizer,
        chat_template,
        ..
    } = model;
    let progress = crate::progress::bar("uploading to the GPU");
    let executor = GpuExecutor::new(transformer, &opts, &libs, &|d, t| progress.update(d, t))?;
    progress.finish();
    let weight_bytes = executor.weight_bytes();
    let engine = EngineHandle::start_with(Box::new(executor), tokenizer, chat_template, config)?;
    Ok((engine, weight_bytes))
}
