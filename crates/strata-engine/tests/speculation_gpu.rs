//! Speculative decoding on the GPU, its verification steps captured as CUDA graphs: the default
//! model's greedy output token for token the same with and without prompt lookup, alone and batched.
#![cfg(feature = "cuda")]

mod common;

use common::{default_model, run_together};
use strata_engine::{EngineConfig, EngineHandle, GenerationRequest, NgramSpeculation};
use strata_model::cuda::{ComputeDtype, GpuExecutor, GpuOptions, GpuQuantization};
use strata_model::kv_cache::KvCacheDtype;
use strata_runtime::cpu::ActPrecision;
use strata_runtime::cuda::{libraries, Gpu};

/// An engine on GPU 0 with `ngram` speculation, or `None` (the reason printed) without a GPU.
fn gpu_engine(ngram: NgramSpeculation) -> Option<EngineHandle> {
    let libs = libraries::search(&libraries::candidate_dirs());
    match Gpu::count(&libs) {
        Ok(n) if n > 0 => {}
        Ok(_) => {
            eprintln!("skipped: no CUDA GPU");
            return None;
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            return None;
        }
    }
    let model = default_model();
    let opts = GpuOptions {
        ordinal: 0,
        gpu_memory_utilization: 0.2,
        gpu_memory_limit: None,
        quantization: GpuQuantization::Auto,
        dtype: ComputeDtype::Bf16,
        kv_cache_dtype: KvCacheDtype::Auto,
        block_size: 16,
        max_num_batched_tokens: 512,
        max_num_seqs: 8,
        max_model_len: 512,
        enforce_eager: false,
        deterministic: false,
        ablate: Vec::new(),
        activation_precision: ActPrecision::High,
    };
    let executor = GpuExecutor::new(model.transformer, &opts, &libs, &|_, _| {}).expect("the GPU executor starts");
    let config = EngineConfig {
        speculative_ngram: Some(ngram),
        max_model_len: Some(512),
        ..Default::default()
    };
    let engine = EngineHandle::start_with_draft(Box::new(executor), None, model.tokenizer, model.chat_template, config);
    Some(engine.expect("engine starts"))
}

/// Input-grounded prompts (drafts are often right) and a free one.
const PROMPTS: [&str; 4] = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "{\"name\": \"Ada\", \"age\": 36, \"city\": \"London\"} rewritten as JSON with the same keys: {\"name\":",
    "Once upon a time, in a town by the sea,",
];

/// The requests, 40 greedy tokens each, the `plain` ones opted out of speculation.
fn requests(e: &EngineHandle, which: &[(usize, bool)]) -> Vec<GenerationRequest> {
    which
        .iter()
        .map(|&(i, plain)| {
            let prompt = e.tokenizer().encode(PROMPTS[i], true, false).expect("encodes");
            GenerationRequest {
                ignore_eos: true,
                speculative: !plain,
                ..GenerationRequest::greedy(prompt, 40)
            }
        })
        .collect()
}

/// Drafts of up to 3 tokens keep two sequences' verification steps within one graph bucket of 8
/// rows, whose attention splits each context as a plain decode step of 1 or 2 rows does on an
/// H200, so the rows' numbers are the same and greedy output must be too.
#[test]
fn greedy_output_on_the_gpu_is_the_same_with_and_without_speculation() {
    let ngram = NgramSpeculation {
        disable_by_batch_size: usize::MAX,
        ..NgramSpeculation::parse("3:1:3").expect("parses")
    };
    let Some(spec) = gpu_engine(ngram) else { return };
    // The same engine with speculation opted out request by request is the reference.
    let cases: [&[(usize, bool)]; 6] = [
        &[(0, false)],
        &[(1, false)],
        &[(2, false)],
        &[(3, false)],
        &[(0, false), (2, true)],
        &[(1, false), (2, false)],
    ];
    for case in cases {
        let off: Vec<(usize, bool)> = case.iter().map(|&(i, _)| (i, true)).collect();
        let want = run_together(&spec, requests(&spec, &off));
        let got = run_together(&spec, requests(&spec, case));
        for (k, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(
                w.tokens, g.tokens,
                "case {case:?}, request {k}: speculation changed the greedy output"
            );
        }
    }
    let d = spec.stats().drafts;
    let (proposed, accepted) = (d.proposed_total(), d.accepted_total());
    eprintln!("GPU drafts: {proposed} proposed, {accepted} accepted");
    assert!(
        accepted > 0 && accepted <= proposed,
        "drafts were proposed and taken: {proposed} / {accepted}"
    );
}
