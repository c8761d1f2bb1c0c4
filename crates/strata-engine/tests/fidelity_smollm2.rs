//! Fidelity of the CPU forward pass: SmolLM2 logits and greedy text against an independent
//! float64 numpy reference (scripts/reference_smollm2.py over the `gguf` package's dequantization).

use strata_engine::{complete, ActPrecision, EngineConfig, EngineHandle, GenerationRequest};
use strata_model::chat_template::ChatMessage;
use strata_model::kv_cache::KvCacheDtype;
use strata_model::loader::{default_model_path, load_model};
use strata_model::{LogitsWanted, PagedKvCache, SeqChunk};
use strata_runtime::cpu::ThreadPool;

const REFERENCE: &str = include_str!("../../../tests/fidelity/smollm2_reference.json");

#[test]
fn smollm2_matches_the_numpy_reference() {
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run `make fetch` first", path.display());
    let model = load_model(&path, &|_, _| {}).expect("default model loads");
    let reference: serde_json::Value = serde_json::from_str(REFERENCE).expect("reference JSON parses");
    let pool = ThreadPool::new(2);
    // Greedy continuations go through the engine, as every caller's do.
    // `high` activations: greedy text is checked token for token against the reference.
    let engine_config = EngineConfig {
        threads: 2,
        kv_cache_memory: 64 << 20,
        max_model_len: Some(1024),
        activation_precision: ActPrecision::High,
        ..Default::default()
    };
    let engine = EngineHandle::start(load_model(&path, &|_, _| {}).unwrap(), engine_config).unwrap();
    let prompts = reference["prompts"].as_array().expect("prompts");
    assert!(prompts.len() >= 4, "the reference covers at least 4 prompts");
    let (mut max_rel, mut max_abs, mut positions) = (0.0f64, 0.0f64, 0usize);
    // The FP8 KV cache against the f32 one, over the whole vocabulary.
    let (mut fp8_max_abs, mut fp8_max_rel, mut fp8_top1_equal) = (0.0f64, 0.0f64, 0usize);
    let (mut fp8_sum_abs, mut fp8_values) = (0.0f64, 0usize);
    for p in prompts {
        let text = p["text"].as_str().unwrap();
        let ids: Vec<u32> = p["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        // The ids the reference saw are the ids strata's tokenizer makes for this text.
        let ours = if p["chat"].as_bool().unwrap() {
            let rendered = model.chat_template.render(&[ChatMessage::user(text)], true).unwrap();
            model.tokenizer.encode(&rendered, false, true).unwrap()
        } else {
            model.tokenizer.encode(text, true, false).unwrap()
        };
        assert_eq!(
            ours, ids,
            "tokenization of {text:?} changed since the reference was made"
        );

        // Logits at every prompt position.
        let cfg = &model.transformer.config;
        let mut kv = PagedKvCache::new(cfg, KvCacheDtype::Auto, 16, ids.len().div_ceil(16));
        let chunk = SeqChunk {
            tokens: ids.clone(),
            first_pos: 0,
            block_table: (0..ids.len().div_ceil(16) as u32).collect(),
            logits: LogitsWanted::All,
            prompt_len: usize::MAX,
            adjust: None,
        };
        let logits = model
            .transformer
            .forward(std::slice::from_ref(&chunk), &mut kv, &pool, &mut Default::default())
            .unwrap();
        let mut kv8 = PagedKvCache::new(cfg, KvCacheDtype::Fp8E4m3, 16, ids.len().div_ceil(16));
        let logits8 = model
            .transformer
            .forward(&[chunk], &mut kv8, &pool, &mut Default::default())
            .unwrap();
        for r in 0..logits.rows.len() {
            let (a, b) = (logits.row(r), logits8.row(r));
            let scale = a.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
            let err = a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs() as f64));
            fp8_sum_abs += a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).sum::<f64>();
            fp8_values += a.len();
            fp8_max_abs = fp8_max_abs.max(err);
            fp8_max_rel = fp8_max_rel.max(err / scale);
            fp8_top1_equal += usize::from(strata_engine::sampler::argmax(a) == strata_engine::sampler::argmax(b));
        }
        for (pos, want) in p["positions"].as_array().unwrap().iter().enumerate() {
            let row = logits.row(pos);
            let top_ids: Vec<usize> = want["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let top_logits: Vec<f64> = want["logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            let our_top1 = strata_engine::sampler::argmax(row) as usize;
            assert_eq!(
                our_top1, top_ids[0],
                "{text:?} position {pos}: top-1 differs from the reference"
            );
            let scale = top_logits.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (&id, &r) in top_ids.iter().zip(&top_logits) {
                let err = (row[id] as f64 - r).abs();
                max_abs = max_abs.max(err);
                max_rel = max_rel.max(err / scale);
            }
            positions += 1;
        }

        // Greedy continuation.
        let want: Vec<u32> = p["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let req = GenerationRequest {
            ignore_eos: true,
            ..GenerationRequest::greedy(ids.clone(), want.len())
        };
        let got = complete(engine.submit(req).unwrap(), &mut |_| {}).unwrap().tokens;
        assert_eq!(got, want, "{text:?}: greedy continuation differs from the reference");
    }
    println!(
        "fidelity: {} prompts, {positions} positions: top-1 equal everywhere; top-10 logits max abs error {max_abs:.4}, max relative error {:.3}%",
        prompts.len(),
        max_rel * 100.0
    );
    println!(
        "fp8 e4m3 KV cache vs f32: top-1 equal at {fp8_top1_equal}/{positions} positions; logits mean abs error \
         {:.4}, max abs error {fp8_max_abs:.4}, max relative error {:.2}% (of the row's largest logit)",
        fp8_sum_abs / fp8_values as f64,
        fp8_max_rel * 100.0
    );
    assert!(
        fp8_top1_equal * 100 >= positions * 90,
        "fp8 KV changes the top-1 token too often"
    );
    // A 135M model with sharp attention is hard on 3-bit mantissas; this guards against regressions.
    assert!(fp8_max_rel < 0.30, "fp8 KV logits drift {:.3}%", fp8_max_rel * 100.0);
    assert!(
        max_rel < 0.02,
        "logits drift from the reference: max relative error {:.3}%",
        max_rel * 100.0
    );
}
