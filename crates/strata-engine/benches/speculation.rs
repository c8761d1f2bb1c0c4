//! Speculative decoding (prompt lookup, or a draft model) side by side with it off, on the default model:
//! closed-loop users on input-grounded chat prompts, on/off runs interleaved per level; prints a table, writes JSON to bench/results/.
//!
//! `cargo bench -p strata-engine --bench speculation -- [--threads 2] [--levels 1,4,16,64]
//! [--speculative-ngram 3:1:4 | --speculative-model PATH [--num-speculative-tokens 4]]
//! [--speculative-disable-by-batch-size N] [--output-len 128] [--rounds 2] [--requests N]
//! [--show-outputs] [--out PATH]`
//!
//! One engine speculates (`--speculative-ngram`, the default, or `--speculative-model`; by
//! default at any batch size, to measure where it stops paying); the "off" runs send the same
//! requests with `speculative: false`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use strata_engine::speculation::DEFAULT_DRAFT_MODEL_TOKENS;
use strata_engine::{complete, DraftModelSpeculation, EngineConfig, EngineHandle, GenerationRequest, NgramSpeculation};
use strata_model::chat_template::ChatMessage;
use strata_model::loader::load_model;

mod common;

struct Options {
    threads: usize,
    levels: Vec<usize>,
    output_len: usize,
    rounds: usize,
    /// Requests a run sends, at least (default: twice the users, at least 8).
    requests: usize,
    ngram: NgramSpeculation,
    /// Draft with this model instead of prompt lookup.
    draft_model: Option<std::path::PathBuf>,
    draft_tokens: usize,
    /// Print each task's answer once (what the drafts are verified against).
    show_outputs: bool,
    out: std::path::PathBuf,
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        threads: 2,
        levels: vec![1, 4, 16, 64],
        output_len: 128,
        rounds: 2,
        requests: 8,
        draft_model: None,
        draft_tokens: DEFAULT_DRAFT_MODEL_TOKENS,
        ngram: NgramSpeculation {
            disable_by_batch_size: usize::MAX,
            ..NgramSpeculation::parse("3:1:4")?
        },
        show_outputs: false,
        out: common::results_path(None, "engine_speculation.json"),
    };
    let args = common::bench_args();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--threads" => o.threads = number(value()?)?,
            "--output-len" => o.output_len = number(value()?)?,
            "--rounds" => o.rounds = number(value()?)?.max(1),
            "--levels" => o.levels = common::levels(&value()?)?,
            "--speculative-ngram" => {
                o.ngram = NgramSpeculation {
                    disable_by_batch_size: o.ngram.disable_by_batch_size,
                    ..NgramSpeculation::parse(&value()?)?
                }
            }
            "--speculative-model" => o.draft_model = Some(value()?.into()),
            "--num-speculative-tokens" => o.draft_tokens = number(value()?)?,
            "--requests" => o.requests = number(value()?)?.max(1),
            "--speculative-disable-by-batch-size" => o.ngram.disable_by_batch_size = number(value()?)?,
            "--show-outputs" => o.show_outputs = true,
            "--out" => o.out = common::results_path(Some(&value()?), ""),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(o)
}

/// Input-grounded tasks (the answer quotes or rewrites its input), shared with the GPU client.
fn tasks() -> Vec<String> {
    let file: serde_json::Value =
        serde_json::from_str(include_str!("../../../bench/speculation_tasks.json")).expect("the tasks file is JSON");
    let tasks = file["tasks"].as_array().expect("a list of tasks");
    tasks
        .iter()
        .map(|t| t.as_str().expect("a task is text").to_string())
        .collect()
}

fn prompts(e: &EngineHandle) -> Vec<Vec<u32>> {
    tasks()
        .iter()
        .map(|task| {
            let text = e
                .chat_template()
                .render(&[ChatMessage::user(task)], true)
                .expect("the chat template renders");
            e.tokenizer().encode(&text, false, true).expect("encodes")
        })
        .collect()
}

/// Figures of one run.
struct Run {
    output_tokens: usize,
    wall_s: f64,
    /// Median over requests of generated tokens per second after the first.
    decode_tps_p50: f64,
    proposed: u64,
    accepted: u64,
    steps: u64,
    /// Mean time of the steps that only decoded (verification steps included).
    decode_step_ms: f64,
    /// Accepted over proposed by position in the draft (0 = first).
    acceptance_by_position: Vec<f64>,
    /// Seconds the draft model ran.
    draft_s: f64,
}

/// `users` closed-loop users, `2 * users` requests (at least `min_requests`), each until
/// end-of-generation or `output_len` tokens.
fn run(
    e: &EngineHandle,
    prompts: &[Vec<u32>],
    users: usize,
    min_requests: usize,
    output_len: usize,
    speculative: bool,
) -> Run {
    let requests = (users * 2).max(min_requests);
    let next = AtomicUsize::new(0);
    let results = Mutex::new((0usize, Vec::new()));
    let before = e.stats();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..users {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= requests {
                    return;
                }
                let req = GenerationRequest {
                    speculative,
                    ..GenerationRequest::greedy(prompts[i % prompts.len()].clone(), output_len)
                };
                let c = complete(e.submit(req).expect("the bench request is valid"), &mut |_| {})
                    .expect("the bench request succeeds");
                let mut r = results.lock().expect("not poisoned");
                r.0 += c.tokens.len();
                r.1.push(c.decode_tps());
            });
        }
    });
    let wall_s = t0.elapsed().as_secs_f64();
    let after = e.stats();
    let (output_tokens, mut tps) = results.into_inner().expect("not poisoned");
    tps.sort_by(f64::total_cmp);
    Run {
        output_tokens,
        wall_s,
        decode_tps_p50: tps[tps.len() / 2],
        proposed: after.drafts.proposed_total() - before.drafts.proposed_total(),
        accepted: after.drafts.accepted_total() - before.drafts.accepted_total(),
        steps: after.steps_total - before.steps_total,
        draft_s: after.draft_seconds_total - before.draft_seconds_total,
        acceptance_by_position: (0..after.drafts.proposed.len())
            .map(|i| {
                let was = |v: &[u64]| v.get(i).copied().unwrap_or(0);
                let proposed = after.drafts.proposed[i] - was(&before.drafts.proposed);
                let accepted = after.drafts.accepted[i] - was(&before.drafts.accepted);
                accepted as f64 / proposed.max(1) as f64
            })
            .collect(),
        decode_step_ms: (after.decode_step_seconds_total - before.decode_step_seconds_total) * 1e3
            / (after.decode_steps_total - before.decode_steps_total).max(1) as f64,
    }
}

fn main() {
    let o = common::options_or_exit(options());
    let (path, model) = common::default_model_or_exit();
    let config = EngineConfig {
        threads: o.threads,
        max_model_len: Some(2048),
        max_num_seqs: 64,
        max_num_batched_tokens: 512,
        kv_cache_memory: 2 << 30,
        ..Default::default()
    };
    let e = match &o.draft_model {
        None => EngineHandle::start(
            model,
            EngineConfig {
                speculative_ngram: Some(o.ngram),
                ..config
            },
        ),
        Some(draft_path) => {
            let draft = load_model(draft_path, &|_, _| {}).unwrap_or_else(|e| {
                eprintln!("error: cannot load --speculative-model {}: {e}", draft_path.display());
                std::process::exit(1)
            });
            let settings = DraftModelSpeculation {
                num_tokens: o.draft_tokens,
                disable_by_batch_size: o.ngram.disable_by_batch_size,
            };
            EngineHandle::start_with_draft_model(
                model,
                Some(draft),
                EngineConfig {
                    speculative_model: Some(settings),
                    ..config
                },
            )
        }
    }
    .unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(1)
    });
    let ps = prompts(&e);
    if o.show_outputs {
        for p in &ps {
            let c = complete(
                e.submit(GenerationRequest::greedy(p.clone(), o.output_len))
                    .expect("valid"),
                &mut |_| {},
            );
            eprintln!("---\n{}", c.expect("succeeds").text);
        }
    }
    // Warm-up: page in weights, fill caches, and the prompts' prefix blocks for both modes.
    run(&e, &ps, 4, 8, 8, false);
    run(&e, &ps, 4, 8, 8, true);
    println!("| users | round | off tok/s | on tok/s | on/off | off p50 user tok/s | on p50 user tok/s | user on/off | acceptance | tokens/step on | decode step ms off / on | drafting s |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut by_position = Vec::new();
    for &users in &o.levels {
        for round in 0..o.rounds {
            // Off first in even rounds, on first in odd ones: drift in the machine's load cancels.
            let order = if round % 2 == 0 { [false, true] } else { [true, false] };
            let mut got: [Option<Run>; 2] = [None, None];
            for speculative in order {
                got[speculative as usize] = Some(run(&e, &ps, users, o.requests, o.output_len, speculative));
            }
            let [Some(off), Some(on)] = got else {
                unreachable!("both modes ran")
            };
            let tps = |r: &Run| r.output_tokens as f64 / r.wall_s;
            let acceptance = on.accepted as f64 / on.proposed.max(1) as f64;
            let per_step = on.output_tokens as f64 / on.steps.max(1) as f64;
            println!(
                "| {users} | {round} | {:.1} | {:.1} | {:.2}x | {:.1} | {:.1} | {:.2}x | {acceptance:.2} | {per_step:.2} | {:.2} / {:.2} | {:.2} |",
                tps(&off),
                tps(&on),
                tps(&on) / tps(&off),
                off.decode_tps_p50,
                on.decode_tps_p50,
                on.decode_tps_p50 / off.decode_tps_p50,
                off.decode_step_ms,
                on.decode_step_ms,
                on.draft_s
            );
            let rates: Vec<String> = on.acceptance_by_position.iter().map(|a| format!("{a:.2}")).collect();
            by_position.push(format!("{users} users, round {round}: {}", rates.join(" ")));
            rows.push(serde_json::json!({
                "users": users, "round": round,
                "off_tok_s": tps(&off), "on_tok_s": tps(&on), "ratio": tps(&on) / tps(&off),
                "off_user_tok_s_p50": off.decode_tps_p50, "on_user_tok_s_p50": on.decode_tps_p50,
                "user_ratio": on.decode_tps_p50 / off.decode_tps_p50,
                "drafts_proposed": on.proposed, "drafts_accepted": on.accepted, "acceptance": acceptance,
                "off_output_tokens": off.output_tokens, "on_output_tokens": on.output_tokens,
                "off_steps": off.steps, "on_steps": on.steps,
                "off_decode_step_ms": off.decode_step_ms, "on_decode_step_ms": on.decode_step_ms,
                "acceptance_by_position": on.acceptance_by_position,
                "on_draft_seconds": on.draft_s, "on_wall_seconds": on.wall_s, "off_wall_seconds": off.wall_s,
            }));
        }
    }
    println!("acceptance by draft position (0 = first):");
    for line in &by_position {
        println!("  {line}");
    }
    let n = o.ngram;
    let file_name = |p: &std::path::Path| p.file_name().and_then(|f| f.to_str()).unwrap_or("?").to_string();
    let mut json = serde_json::json!({
        "model": file_name(&path),
        "threads": o.threads,
        "output_len": o.output_len,
        "disable_by_batch_size": (n.disable_by_batch_size != usize::MAX).then_some(n.disable_by_batch_size),
        "runs": rows,
    });
    let method = match &o.draft_model {
        None => [(
            "speculative_ngram",
            format!("{}:{}:{}", n.lookup_max, n.lookup_min, n.num_tokens).into(),
        )]
        .to_vec(),
        Some(draft) => [
            ("speculative_model", file_name(draft).into()),
            ("num_speculative_tokens", o.draft_tokens.into()),
        ]
        .to_vec(),
    };
    for (key, value) in method {
        json[key] = value;
    }
    let json = json.to_string() + "\n";
    if let Some(dir) = o.out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    match std::fs::write(&o.out, json) {
        Ok(()) => println!("wrote {}", o.out.display()),
        Err(e) => eprintln!("error: cannot write {}: {e}", o.out.display()),
    }
}
