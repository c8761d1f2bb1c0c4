//! `--speculative-model` end to end: a re-quantized copy of the default model drafting for it
//! changes no greedy token; and `strata serve`'s one-line refusals of drafts it cannot use.

mod common;

#[allow(dead_code)]
#[path = "../../strata-model/tests/common/tiny_hf.rs"]
mod tiny_hf;

use strata_engine::{complete, DraftModelSpeculation, EngineConfig, EngineHandle, GenerationRequest};
use strata_formats::safetensors::Dtype;
use strata_model::loader::load_model;

use common::{default_model, exits_with_one_line, scratch_dir, strata};

/// The default model (Q4_1) verifies drafts of its Q8_0 copy (`strata quantize`): the greedy
/// output is the one without a draft model, and most drafts, not all, are taken.
#[test]
fn a_requantized_draft_changes_no_greedy_token() {
    let dir = scratch_dir("speculative-model");
    let draft_path = dir.join("draft-q8_0.gguf");
    let out = strata()
        .arg("quantize")
        .arg(default_model())
        .arg(&draft_path)
        .args(["--type", "Q8_0", "--threads", "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "quantize: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let load = |path: &std::path::Path| load_model(path, &|_, _| {}).unwrap();
    let config = |speculative_model| EngineConfig {
        threads: 1,
        max_model_len: Some(256),
        kv_cache_memory: 64 << 20,
        speculative_model,
        ..Default::default()
    };
    let plain = EngineHandle::start(load(&default_model()), config(None)).unwrap();
    let settings = DraftModelSpeculation {
        disable_by_batch_size: usize::MAX,
        ..DraftModelSpeculation::new(4)
    };
    let spec =
        EngineHandle::start_with_draft_model(load(&default_model()), Some(load(&draft_path)), config(Some(settings)))
            .unwrap();
    let prompts = [
        "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        "Once upon a time, in a town by the sea,",
        "The capital of France is",
    ];
    let requests = |e: &EngineHandle| -> Vec<GenerationRequest> {
        prompts
            .iter()
            .map(|p| GenerationRequest::greedy(e.tokenizer().encode(p, true, false).unwrap(), 40))
            .collect()
    };
    let outputs = |e: &EngineHandle| -> Vec<Vec<u32>> {
        let streams: Vec<_> = requests(e).into_iter().map(|r| e.submit(r).unwrap()).collect();
        streams
            .into_iter()
            .map(|s| complete(s, &mut |_| {}).unwrap().tokens)
            .collect()
    };
    assert_eq!(
        outputs(&plain),
        outputs(&spec),
        "the draft model changed the greedy output"
    );
    let drafts = spec.stats().drafts;
    let (proposed, accepted) = (drafts.proposed_total(), drafts.accepted_total());
    eprintln!("Q8_0 drafting for Q4_1: {accepted} of {proposed} draft tokens taken");
    assert!(
        proposed > 0 && accepted * 2 > proposed && accepted < proposed,
        "most drafts are taken, not all: {accepted} of {proposed}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Each refusal is one line naming the flag and what to pass instead, before anything serves.
#[test]
fn serve_refuses_a_draft_model_it_cannot_use_in_one_line() {
    let target = default_model();
    let target = target.to_str().unwrap();
    let serve = |extra: &[&str]| -> String {
        let mut args = vec!["serve", "--port", "0", "--device", "cpu", "--model", target];
        args.extend_from_slice(extra);
        exits_with_one_line(&args)
    };
    let msg = serve(&["--speculative-model", "/nonexistent/draft.gguf"]);
    assert!(
        msg.contains("--speculative-model /nonexistent/draft.gguf: no such file"),
        "{msg}"
    );
    let msg = serve(&["--speculative-model", target, "--speculative-ngram", "4"]);
    assert!(msg.contains("pass one of them"), "{msg}");
    let msg = serve(&["--num-speculative-tokens", "4"]);
    assert!(msg.contains("pass --speculative-model PATH"), "{msg}");
    let msg = serve(&["--speculative-model", target, "--num-speculative-tokens", "0"]);
    assert!(msg.contains("--num-speculative-tokens must be in 1..=16"), "{msg}");
    // A checkpoint with its own byte-level vocabulary.
    let dir = scratch_dir("speculative-model-vocab");
    tiny_hf::TinyCheckpoint::new("qwen2", Dtype::BF16, true, 7).write_dir(&dir, 1);
    let msg = serve(&["--speculative-model", dir.to_str().unwrap()]);
    assert!(
        msg.contains("--speculative-model has a vocabulary of") && msg.contains("shares its tokenizer"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
