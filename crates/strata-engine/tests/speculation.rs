//! Prompt-lookup speculative decoding on the real default model: greedy and seeded output token
//! for token the same as without it, batched with plain sequences, through preemption; opt-out and the batch-size rule.

use std::collections::BTreeMap;
use std::time::Duration;

use strata_engine::{
    complete, Completion, EngineConfig, EngineHandle, GenerationRequest, KvCacheDtype, NgramSpeculation, RequestStream,
    SamplingParams,
};
use strata_model::loader::{default_model_path, load_model};

fn engine(config: EngineConfig) -> EngineHandle {
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run `make fetch` first", path.display());
    let model = load_model(&path, &|_, _| {}).expect("default model loads");
    EngineHandle::start(model, config).expect("engine starts")
}

/// One compute thread (the harness runs tests side by side), and a cache small enough that 8
/// sequences of ~60 + 48 tokens preempt each other (room for 24 blocks of 16 tokens).
fn config(speculative_ngram: Option<NgramSpeculation>) -> EngineConfig {
    let model = load_model(&default_model_path(), &|_, _| {}).expect("default model loads");
    let per_token = strata_model::PagedKvCache::bytes_per_token(&model.transformer.config, KvCacheDtype::Auto);
    EngineConfig {
        threads: 1,
        kv_cache_memory: per_token * 16 * 24,
        max_model_len: Some(256),
        speculative_ngram,
        ..Default::default()
    }
}

/// Drafts of 4 tokens from n-grams of 1 to 3, speculating at any batch size.
fn ngram() -> Option<NgramSpeculation> {
    Some(NgramSpeculation {
        disable_by_batch_size: usize::MAX,
        ..NgramSpeculation::parse("3:1:4").expect("parses")
    })
}

/// Input-grounded prompts (the answer repeats the input, so drafts are often right) and free ones.
fn prompts(e: &EngineHandle) -> Vec<Vec<u32>> {
    let texts = [
        "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        "{\"name\": \"Ada\", \"age\": 36, \"city\": \"London\"} rewritten as JSON with the same keys: {\"name\":",
        "Once upon a time, in a town by the sea,",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
        "Quote the passage: 'All happy families are alike; each unhappy family is unhappy in its own way.' Quote: 'All",
        "The capital of France is",
        "Red, green, blue. Red, green, blue. Red, green,",
    ];
    texts
        .iter()
        .map(|t| e.tokenizer().encode(t, true, false).expect("encodes"))
        .collect()
}

fn run_together(e: &EngineHandle, reqs: Vec<GenerationRequest>) -> Vec<Completion> {
    let streams: Vec<RequestStream> = reqs.into_iter().map(|r| e.submit(r).expect("submit")).collect();
    streams
        .into_iter()
        .map(|s| complete(s, &mut |_| {}).expect("request succeeds"))
        .collect()
}

/// Greedy requests of different lengths; some stop at end-of-generation, one opts out.
fn greedy_requests(ps: &[Vec<u32>]) -> Vec<GenerationRequest> {
    ps.iter()
        .enumerate()
        .map(|(i, p)| GenerationRequest {
            ignore_eos: i % 3 != 2,
            speculative: i != 6,
            ..GenerationRequest::greedy(p.clone(), 30 + 3 * i)
        })
        .collect()
}

#[test]
fn greedy_output_is_the_same_with_and_without_speculation_batched_and_preempted() {
    let plain = engine(config(None));
    let spec = engine(config(ngram()));
    let ps = prompts(&plain);
    let want = run_together(&plain, greedy_requests(&ps));
    let got = run_together(&spec, greedy_requests(&ps));
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.tokens, g.tokens, "request {i}: speculation changed the greedy output");
        assert_eq!(w.text, g.text);
        assert_eq!(w.finish, g.finish);
    }
    assert!(spec.wait_idle(Duration::from_secs(10)));
    let s = spec.stats();
    assert!(
        s.preemptions_total > 0,
        "the cache was too small, so something was preempted: {s:?}"
    );
    let (proposed, accepted) = (s.drafts.proposed_total(), s.drafts.accepted_total());
    assert!(
        accepted > 0 && accepted < proposed,
        "drafts were proposed and some taken: {s:?}"
    );
    assert_eq!(s.kv_blocks_used, 0, "every block is back, rejected drafts' included");
    assert_eq!(plain.stats().drafts.proposed_total(), 0);
    // Alone, each as it was in the batch.
    for i in [0, 2, 5] {
        let alone = run_together(&spec, vec![greedy_requests(&ps).remove(i)]);
        assert_eq!(alone[0].tokens, want[i].tokens, "request {i} alone");
    }
}

#[test]
fn seeded_sampling_gives_the_same_tokens_and_histogram_with_and_without_speculation() {
    let plain = engine(config(None));
    let spec = engine(config(ngram()));
    let ps = prompts(&plain);
    let requests = |seeds: std::ops::Range<u64>| -> Vec<GenerationRequest> {
        seeds
            .map(|seed| GenerationRequest {
                sampling: SamplingParams {
                    temperature: 0.7,
                    top_p: 0.95,
                    seed,
                    ..Default::default()
                },
                ignore_eos: true,
                ..GenerationRequest::greedy(ps[(seed % 3) as usize].clone(), 24)
            })
            .collect()
    };
    let mut histograms = [BTreeMap::<u32, u64>::new(), BTreeMap::new()];
    // Many seeded draws, 8 at a time, with and without speculation.
    for batch in 0..6u64 {
        let seeds = batch * 8..batch * 8 + 8;
        let want = run_together(&plain, requests(seeds.clone()));
        let got = run_together(&spec, requests(seeds));
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(w.tokens, g.tokens, "a seed gave other tokens under speculation");
            for (h, c) in histograms.iter_mut().zip([w, g]) {
                c.tokens.iter().for_each(|&t| *h.entry(t).or_default() += 1);
            }
        }
    }
    assert_eq!(histograms[0], histograms[1]);
    assert!(histograms[0].len() > 20, "sampling spreads over many tokens");
    let s = spec.stats();
    assert!(s.drafts.accepted_total() > 0, "sampled drafts were accepted too: {s:?}");
    // Seeds repeat: the same seed again, now alone, gives the same tokens.
    let again = run_together(&spec, requests(3..4));
    let first = run_together(&plain, requests(3..4));
    assert_eq!(again[0].tokens, first[0].tokens);
}

#[test]
fn opted_out_requests_and_large_batches_do_not_draft() {
    let spec = engine(config(ngram()));
    let ps = prompts(&spec);
    let mut reqs = greedy_requests(&ps[..2]);
    reqs.iter_mut().for_each(|r| r.speculative = false);
    run_together(&spec, reqs);
    assert_eq!(spec.stats().drafts.proposed_total(), 0, "opted out");
    // Speculation is off while more sequences than the threshold run or wait.
    let busy = engine(config(Some(NgramSpeculation {
        disable_by_batch_size: 2,
        ..ngram().expect("set")
    })));
    let together = run_together(&busy, greedy_requests(&ps[..4]));
    let drafted_at_four = busy.stats().drafts.proposed_total();
    // The last one still running alone drafts again.
    assert!(together.iter().all(|c| !c.tokens.is_empty()));
    let alone = run_together(&busy, greedy_requests(&ps[..1]));
    assert_eq!(alone[0].tokens, together[0].tokens);
    assert!(
        busy.stats().drafts.proposed_total() > drafted_at_four,
        "alone, it drafts"
    );
}
