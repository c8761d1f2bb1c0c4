//! Speculative decoding on the real default model, by prompt lookup and by a draft model: greedy
//! and seeded output token for token the same as without it, batched with plain sequences, through preemption; opt-out, the batch-size rule, refusals.

use std::collections::BTreeMap;
use std::time::Duration;

mod common;

use common::{default_model, run_together};
use strata_engine::{
    cpu_draft_executor, cpu_executor, ActPrecision, Completion, DraftCounts, DraftModel, DraftModelSpeculation,
    EngineConfig, EngineError, EngineHandle, GenerationRequest, KvCacheDtype, NgramSpeculation, SamplingParams,
};
use strata_model::loader::cache_dir;
use strata_model::tokenizer::Tokenizer;
use strata_model::{CpuExecutor, Executor, Transformer};

fn engine(config: EngineConfig) -> EngineHandle {
    EngineHandle::start(default_model(), config).expect("engine starts")
}

/// One compute thread (the harness runs tests side by side), and a cache small enough that 8
/// sequences of ~60 + 48 tokens preempt each other (room for 24 blocks of 16 tokens).
fn config() -> EngineConfig {
    let model = default_model();
    let per_token = strata_model::PagedKvCache::bytes_per_token(&model.transformer.config, KvCacheDtype::Auto);
    EngineConfig {
        threads: 1,
        kv_cache_memory: per_token * 16 * 24,
        max_model_len: Some(256),
        ..Default::default()
    }
}

/// Drafts of 4 tokens from n-grams of 1 to 3, speculating at any batch size.
fn ngram() -> NgramSpeculation {
    NgramSpeculation {
        disable_by_batch_size: usize::MAX,
        ..NgramSpeculation::parse("3:1:4").expect("parses")
    }
}

fn ngram_config(ngram: NgramSpeculation) -> EngineConfig {
    EngineConfig {
        speculative_ngram: Some(ngram),
        ..config()
    }
}

/// Drafts of 4 tokens from a draft model, at any batch size.
fn four_tokens() -> DraftModelSpeculation {
    DraftModelSpeculation {
        disable_by_batch_size: usize::MAX,
        ..DraftModelSpeculation::new(4)
    }
}

fn draft_config(settings: DraftModelSpeculation) -> EngineConfig {
    EngineConfig {
        speculative_model: Some(settings),
        ..config()
    }
}

/// The default model drafting for itself.
fn self_drafting(settings: DraftModelSpeculation) -> EngineHandle {
    EngineHandle::start_with_draft_model(default_model(), Some(default_model()), draft_config(settings))
        .expect("engine starts")
}

/// The default model drafting for itself on the executor `make_draft` builds from the draft's
/// transformer, the config and the target's executor.
fn engine_with_draft(make_draft: impl FnOnce(Transformer, &EngineConfig, &CpuExecutor) -> CpuExecutor) -> EngineHandle {
    let config = draft_config(four_tokens());
    let target = default_model();
    let target_executor = cpu_executor(target.transformer, &config).expect("executor");
    let draft = default_model();
    let draft = DraftModel {
        executor: Box::new(make_draft(draft.transformer, &config, &target_executor)),
        tokenizer: draft.tokenizer,
    };
    EngineHandle::start_with_draft(
        Box::new(target_executor),
        Some(draft),
        target.tokenizer,
        target.chat_template,
        config,
    )
    .expect("engine starts")
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

/// Greedy requests of different lengths; with `stop_at_eos` some stop at end-of-generation; one
/// (index 6) opts out.
fn greedy_requests(ps: &[Vec<u32>], stop_at_eos: bool) -> Vec<GenerationRequest> {
    ps.iter()
        .enumerate()
        .map(|(i, p)| GenerationRequest {
            ignore_eos: !stop_at_eos || i % 3 != 2,
            speculative: i != 6,
            ..GenerationRequest::greedy(p.clone(), 30 + 3 * i)
        })
        .collect()
}

fn assert_same(want: &[Completion], got: &[Completion]) {
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        assert_eq!(w.tokens, g.tokens, "request {i}: speculation changed the greedy output");
        assert_eq!(w.text, g.text);
        assert_eq!(w.finish, g.finish);
    }
}

/// Greedy requests batched on `spec` give `plain`'s tokens, and each of three alone too.
fn assert_greedy_unchanged(plain: &EngineHandle, spec: &EngineHandle) {
    let ps = prompts(plain);
    let want = run_together(plain, greedy_requests(&ps, true));
    assert_same(&want, &run_together(spec, greedy_requests(&ps, true)));
    for i in [0, 2, 5] {
        let alone = run_together(spec, vec![greedy_requests(&ps, true).remove(i)]);
        assert_eq!(alone[0].tokens, want[i].tokens, "request {i} alone");
    }
}

/// Many seeded draws, 8 at a time, on `plain` and `spec`: the same tokens seed by seed (so the
/// same histogram), over many tokens; a seed again alone repeats. The drafts of `spec`'s draws.
fn assert_seeded_sampling_unchanged(plain: &EngineHandle, spec: &EngineHandle) -> DraftCounts {
    let ps = prompts(plain);
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
    for batch in 0..6u64 {
        let seeds = batch * 8..batch * 8 + 8;
        let want = run_together(plain, requests(seeds.clone()));
        let got = run_together(spec, requests(seeds));
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(w.tokens, g.tokens, "a seed gave other tokens under speculation");
            for (h, c) in histograms.iter_mut().zip([w, g]) {
                c.tokens.iter().for_each(|&t| *h.entry(t).or_default() += 1);
            }
        }
    }
    assert_eq!(histograms[0], histograms[1]);
    assert!(histograms[0].len() > 20, "sampling spreads over many tokens");
    let drafts = spec.stats().drafts;
    // Seeds repeat: the same seed again, now alone, gives the same tokens.
    let again = run_together(spec, requests(3..4));
    let first = run_together(plain, requests(3..4));
    assert_eq!(again[0].tokens, first[0].tokens);
    drafts
}

/// Opted-out requests on `spec` draft nothing; on `busy` (speculation off above 2 sequences) 4
/// requests at once draft less than the last one left, which drafts again.
fn assert_opt_out_and_batch_size_rule(spec: &EngineHandle, busy: &EngineHandle) {
    let ps = prompts(spec);
    let mut reqs = greedy_requests(&ps[..2], true);
    reqs.iter_mut().for_each(|r| r.speculative = false);
    run_together(spec, reqs);
    assert_eq!(spec.stats().drafts.proposed_total(), 0, "opted out");
    assert_eq!(
        spec.stats().drafted_steps_total,
        0,
        "opted out: no step verified drafts"
    );
    assert_eq!(spec.stats().draft_seconds_total, 0.0, "no draft model ran");
    let together = run_together(busy, greedy_requests(&ps[..4], true));
    let drafted_at_four = busy.stats().drafts.proposed_total();
    let alone = run_together(busy, greedy_requests(&ps[..1], true));
    assert_eq!(alone[0].tokens, together[0].tokens);
    assert!(
        busy.stats().drafts.proposed_total() > drafted_at_four,
        "alone, it drafts"
    );
}

#[test]
fn greedy_output_is_the_same_with_and_without_speculation_batched_and_preempted() {
    let plain = engine(config());
    let spec = engine(ngram_config(ngram()));
    assert_greedy_unchanged(&plain, &spec);
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
    assert!(
        s.drafted_steps_total > 0 && s.drafted_steps_total <= s.decode_steps_total,
        "drafted steps are decode steps: {s:?}"
    );
    assert!(s.drafted_step_seconds_total > 0.0 && s.drafted_step_seconds_total <= s.decode_step_seconds_total);
    assert_eq!(plain.stats().drafts.proposed_total(), 0);
    assert_eq!(plain.stats().drafted_steps_total, 0);
}

#[test]
fn seeded_sampling_gives_the_same_tokens_and_histogram_with_and_without_speculation() {
    let drafts = assert_seeded_sampling_unchanged(&engine(config()), &engine(ngram_config(ngram())));
    assert!(
        drafts.accepted_total() > 0,
        "sampled drafts were accepted too: {drafts:?}"
    );
}

#[test]
fn opted_out_requests_and_large_batches_do_not_draft() {
    let busy = NgramSpeculation {
        disable_by_batch_size: 2,
        ..ngram()
    };
    assert_opt_out_and_batch_size_rule(&engine(ngram_config(ngram())), &engine(ngram_config(busy)));
}

#[test]
fn greedy_output_is_the_same_with_a_draft_model_batched_and_preempted() {
    let plain = engine(config());
    let spec = self_drafting(four_tokens());
    let ps = prompts(&plain);
    // Without end-of-generation stops the target takes every draft of itself.
    let want = run_together(&plain, greedy_requests(&ps, false));
    assert_same(&want, &run_together(&spec, greedy_requests(&ps, false)));
    assert!(spec.wait_idle(Duration::from_secs(10)));
    let s = spec.stats();
    assert!(
        s.preemptions_total > 0,
        "the cache was too small, so something was preempted: {s:?}"
    );
    assert!(s.drafts.proposed_total() > 100, "drafts were proposed: {s:?}");
    assert_eq!(
        s.drafts.accepted_total(),
        s.drafts.proposed_total(),
        "a model drafting for itself is always right: {s:?}"
    );
    assert!(s.draft_seconds_total > 0.0);
    assert_eq!(s.kv_blocks_used, 0, "every block is back, rejected drafts' included");
    assert_eq!(s.draft_kv_blocks_used, 0, "every draft block is back");
    // With stops at end-of-generation: the same output, and nearly every draft taken (a draft
    // past the stop token is not).
    let before = spec.stats().drafts;
    assert_greedy_unchanged(&plain, &spec);
    let after = spec.stats().drafts;
    let proposed = after.proposed_total() - before.proposed_total();
    let accepted = after.accepted_total() - before.accepted_total();
    assert!(
        accepted as f64 >= 0.95 * proposed as f64,
        "{accepted} of {proposed} taken"
    );
}

/// The default model drafting for itself with high-precision activations: other numbers, so
/// other drafts now and then; the output does not change.
#[test]
fn a_different_draft_model_is_sometimes_wrong_and_changes_nothing() {
    let spec = engine_with_draft(|mut transformer, config, target| {
        transformer.act_precision = ActPrecision::High;
        let kv = target.kv_layout();
        CpuExecutor::with_pool(
            transformer,
            config.kv_cache_dtype,
            kv.block_size,
            kv.blocks,
            target.pool(),
        )
    });
    assert_greedy_unchanged(&engine(config()), &spec);
    let s = spec.stats();
    let (proposed, accepted) = (s.drafts.proposed_total(), s.drafts.accepted_total());
    assert!(
        accepted > 0 && accepted < proposed,
        "drafts were proposed, most taken, some not: {s:?}"
    );
    assert!(spec.wait_idle(Duration::from_secs(10)));
    assert_eq!(spec.stats().draft_kv_blocks_used, 0);
}

/// A draft cache of one --max-model-len (16 blocks) for 8 sequences: some draft, some find no
/// room and decode plainly; the output is the same and every draft block comes back.
#[test]
fn a_draft_cache_too_small_for_every_sequence_changes_nothing() {
    let spec = engine_with_draft(|transformer, config, target| {
        let kv = target.kv_layout();
        CpuExecutor::with_pool(transformer, config.kv_cache_dtype, kv.block_size, 16, target.pool())
    });
    assert_greedy_unchanged(&engine(config()), &spec);
    assert!(spec.wait_idle(Duration::from_secs(10)));
    let s = spec.stats();
    assert!(s.drafts.accepted_total() > 0, "some sequences drafted: {s:?}");
    assert_eq!(s.draft_kv_blocks_used, 0, "every draft block is back");
}

#[test]
fn seeded_sampling_gives_the_same_tokens_and_histogram_with_a_draft_model() {
    let drafts = assert_seeded_sampling_unchanged(&engine(config()), &self_drafting(four_tokens()));
    // A greedy draft is the sampled token only where the target's choice is nearly certain.
    assert!(
        drafts.accepted_total() > 0 && drafts.accepted_total() < drafts.proposed_total(),
        "sampled drafts were accepted, not all: {drafts:?}"
    );
}

#[test]
fn opted_out_requests_and_large_batches_do_not_draft_from_a_draft_model() {
    let busy = DraftModelSpeculation {
        disable_by_batch_size: 2,
        ..four_tokens()
    };
    assert_opt_out_and_batch_size_rule(&self_drafting(four_tokens()), &self_drafting(busy));
}

/// The start refuses a draft model with another vocabulary, two methods at once, and settings
/// without a model (or a model without settings), each with a message that says what to pass.
#[test]
fn mismatched_or_doubled_speculation_is_refused_at_start() {
    let start = |draft_tokenizer: Option<Tokenizer>, config: EngineConfig| -> Result<EngineHandle, EngineError> {
        let target = default_model();
        let target_executor = cpu_executor(target.transformer, &config)?;
        let draft = draft_tokenizer.map(|tokenizer| DraftModel {
            executor: Box::new(cpu_draft_executor(
                default_model().transformer,
                &config,
                &target_executor,
            )),
            tokenizer,
        });
        EngineHandle::start_with_draft(
            Box::new(target_executor),
            draft,
            target.tokenizer,
            target.chat_template,
            config,
        )
    };
    let message = |r: Result<EngineHandle, EngineError>| match r {
        Ok(_) => panic!("the engine started"),
        Err(e) => e.to_string(),
    };
    let qwen = cache_dir().join("tokenizers/qwen2.5/tokenizer.json");
    assert!(qwen.exists(), "{} is missing: run `make fetch` first", qwen.display());
    let qwen = Tokenizer::from_hf_file(&qwen, None).expect("the Qwen2.5 tokenizer loads");
    let err = message(start(Some(qwen), draft_config(four_tokens())));
    assert!(
        err.contains("vocabulary of 151") && err.contains("shares its tokenizer"),
        "{err}"
    );
    let both = EngineConfig {
        speculative_ngram: Some(NgramSpeculation::parse("4").expect("parses")),
        ..draft_config(four_tokens())
    };
    let err = message(start(Some(default_model().tokenizer), both));
    assert!(err.contains("pass one of them"), "{err}");
    let err = message(start(None, draft_config(four_tokens())));
    assert!(err.contains("--speculative-model PATH"), "{err}");
    let err = message(start(Some(default_model().tokenizer), config()));
    assert!(err.contains("without --num-speculative-tokens"), "{err}");
    let too_many = draft_config(DraftModelSpeculation::new(99));
    let err = message(start(Some(default_model().tokenizer), too_many));
    assert!(err.contains("--num-speculative-tokens must be in 1..=16"), "{err}");
}
