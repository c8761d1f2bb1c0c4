//! strata-engine: turns prompts into generated tokens on a loaded model, for many users at once.
//! Owns the engine and output threads, scheduler, KV block manager, sequences and sampling; callers use `EngineHandle`.

pub mod block_manager;
pub mod completion;
pub mod constraint;
pub mod draft_model;
pub mod engine;
pub mod outbox;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod speculation;

pub use completion::{complete, Completion};
pub use constraint::{GrammarCompiler, OutputConstraint};
pub use draft_model::DraftModel;
pub use engine::{
    cpu_draft_executor, cpu_executor, EngineConfig, EngineError, EngineHandle, EngineStats, KvCapacity, RequestStream,
};
pub use request::{FinishReason, GenerationRequest, RequestOutput, SubmitError, TokenLogprob, Usage};
pub use sampler::{Sampler, SamplingParams};
pub use speculation::{DraftCounts, DraftModelSpeculation, NgramSpeculation};
pub use strata_model::kv_cache::KvCacheDtype;
pub use strata_runtime::cpu::ActPrecision;
