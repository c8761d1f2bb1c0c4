//! `strata quantize` end to end: the default model re-quantized to each type the GPU tests use,
//! loaded by the CPU backend, its greedy picks checked against the original's; and its one-line errors.

mod common;

use std::path::Path;

use strata_formats::gguf::GgufFile;
use strata_formats::GgmlType;
use strata_model::kv_cache::KvCacheDtype;
use strata_model::loader::{load_model, LoadedModel};
use strata_model::{LogitsWanted, PagedKvCache, SeqChunk};
use strata_runtime::cpu::ThreadPool;

use common::{default_model, exits_with_one_line, scratch_dir, strata};

/// Runs `strata quantize IN OUT --type TY`, asserting success; returns stderr.
fn quantize(input: &Path, output: &Path, ty: &str, threads: usize) -> String {
    let out = strata()
        .arg("quantize")
        .arg(input)
        .arg(output)
        .args(["--type", ty, "--threads", &threads.to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "quantize --type {ty}: {stderr}");
    stderr
}

const PROMPTS: [&str; 4] = [
    "The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
];

/// The logits at every position of every prompt (one prefill each).
fn all_logits(model: &LoadedModel) -> Vec<Vec<f32>> {
    let t = &model.transformer;
    let pool = ThreadPool::new(2);
    let mut scratch = Default::default();
    let mut rows = Vec::new();
    for prompt in PROMPTS {
        let tokens = model.tokenizer.encode(prompt, true, false).unwrap();
        let blocks = tokens.len().div_ceil(16);
        let mut kv = PagedKvCache::new(&t.config, KvCacheDtype::Auto, 16, blocks);
        let chunk = SeqChunk {
            tokens: tokens.clone(),
            first_pos: 0,
            block_table: (0..blocks as u32).collect(),
            logits: LogitsWanted::All,
            prompt_len: usize::MAX,
            adjust: None,
        };
        let logits = t.forward(&[chunk], &mut kv, &pool, &mut scratch).unwrap();
        rows.extend((0..tokens.len()).map(|i| logits.row(i).to_vec()));
    }
    rows
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap_or(0)
}

/// Positions where both pick the same token, and the RMS logit difference over the RMS logit.
fn compare(rows: &[Vec<f32>], reference: &[Vec<f32>]) -> (usize, f64) {
    let same = rows
        .iter()
        .zip(reference)
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for (a, b) in rows.iter().zip(reference) {
        for (&x, &y) in a.iter().zip(b) {
            err += (f64::from(x) - f64::from(y)).powi(2);
            norm += f64::from(y).powi(2);
        }
    }
    (same, (err / norm).sqrt())
}

fn types_of(file: &GgufFile) -> Vec<(String, GgmlType)> {
    file.tensors().iter().map(|t| (t.name.clone(), t.ty)).collect()
}

fn type_of(file: &GgufFile, name: &str) -> GgmlType {
    file.tensor(name).unwrap_or_else(|| panic!("no tensor {name}")).ty
}

/// Each type the GGUF GPU tests need, written from the default model (Q4_1), loads on the CPU
/// backend, keeps the tokenizer and metadata, and picks the same greedy token as the original at
/// nearly every position. SmolLM2's hidden size (576) is not whole K-quant blocks, so K-quant
/// files keep only the matrices with 1536-value rows (ffn_down) in the K type and fall back to Q8_0.
#[test]
fn each_type_loads_and_agrees_with_the_original() {
    let original = default_model();
    let dir = scratch_dir("quantize-types");
    let reference = load_model(&original, &|_, _| {}).unwrap();
    let reference_rows = all_logits(&reference);
    let source = GgufFile::open(&original).unwrap();

    // Per type: the fewest positions of 67 where the greedy pick must agree, and the largest
    // RMS logit difference over the RMS logit. Measured: Q8_0 65 (2.6 %), Q6_K 60 (5.1 %), Q5_K 65
    // (7.0 %), Q4_K 65 (4.8 %), Q4_K_M 59 (5.0 %), Q4_0 41 (31.9 %). The K files are mostly Q8_0
    // (see above); Q4_0 is 4-bit everywhere but the LM head, re-rounded from Q4_1's grid.
    let cases = [
        ("Q8_0", 63, 0.04, GgmlType::Q8_0, 7),
        ("Q6_K", 56, 0.08, GgmlType::Q6K, 18),
        ("Q5_K", 56, 0.09, GgmlType::Q5K, 16),
        ("Q4_K", 56, 0.08, GgmlType::Q4K, 14),
        ("Q4_K_M", 56, 0.08, GgmlType::Q4K, 15),
        ("Q4_0", 36, 0.4, GgmlType::Q4_0, 2),
    ];
    let mut report = Vec::new();
    let mut below = Vec::new();
    for (name, min_same, max_logit_error, down_type, file_type) in cases {
        let path = dir.join(format!("smollm2.{name}.gguf"));
        let stderr = quantize(&original, &path, name, 2);
        assert!(stderr.contains("wrote "), "{stderr}");
        let file = GgufFile::open(&path).unwrap();

        // Metadata copied (tokenizer included), file type set, vectors in F32.
        for (key, value) in source.metadata() {
            if key != "general.file_type" {
                assert_eq!(file.get(key), Some(value), "{name}: metadata {key}");
            }
        }
        assert_eq!(file.get_u64("general.file_type"), Some(file_type));
        assert_eq!(file.get_u64("general.quantization_version"), Some(2));
        let shapes = |f: &GgufFile| {
            f.tensors()
                .iter()
                .map(|t| (t.name.clone(), t.dims.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(shapes(&file), shapes(&source));
        assert_eq!(type_of(&file, "output_norm.weight"), GgmlType::F32);
        assert_eq!(type_of(&file, "blk.4.attn_norm.weight"), GgmlType::F32);
        assert_eq!(type_of(&file, "blk.4.ffn_down.weight"), down_type, "{name}");
        if name.contains("_K") {
            // 576-value rows are not whole 256-value super-blocks.
            assert_eq!(type_of(&file, "blk.4.attn_q.weight"), GgmlType::Q8_0, "{name}");
            assert!(
                stderr.contains("note: ") && stderr.contains("blk.*.attn_q.weight"),
                "{stderr}"
            );
        } else {
            assert_eq!(type_of(&file, "blk.4.attn_q.weight"), down_type, "{name}");
        }
        // The (tied) LM head: Q6_K for the 4- and 5-bit types, which its rows fall back from.
        assert_eq!(type_of(&file, "token_embd.weight"), GgmlType::Q8_0, "{name}");
        if name == "Q4_K_M" {
            // ffn_down of the first eighth (layers 0..3) and every third layer after keep Q6_K.
            assert_eq!(type_of(&file, "blk.0.ffn_down.weight"), GgmlType::Q6K);
            assert_eq!(type_of(&file, "blk.5.ffn_down.weight"), GgmlType::Q6K);
            let counts = types_of(&file).iter().filter(|(_, t)| *t == GgmlType::Q6K).count();
            assert!(counts >= 10, "Q4_K_M has {counts} Q6_K tensors");
        }

        let model = load_model(&path, &|_, _| {}).unwrap();
        let rows = all_logits(&model);
        let (same, logit_error) = compare(&rows, &reference_rows);
        report.push(format!(
            "{name} {same}/{} (logits {:.1}%)",
            rows.len(),
            100.0 * logit_error
        ));
        assert_eq!(rows.len(), 67);
        if same < min_same || logit_error > max_logit_error {
            below.push(name);
        }
        drop(model);
        std::fs::remove_file(&path).unwrap();
    }
    println!("greedy top-1 agreement with the Q4_1 original: {}", report.join(", "));
    assert!(below.is_empty(), "below the bounds: {below:?} ({})", report.join(", "));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every matrix of the default model in Q4_0 (the LM head in Q8_0): the same bytes from one
/// thread as from two, nothing left beside the output, and a chat answer that still knows Paris.
/// (K-quant output against the thread count: see the random-weights test.)
#[test]
fn q4_0_output_is_the_same_for_any_thread_count_and_still_answers() {
    let original = default_model();
    let dir = scratch_dir("quantize-deterministic");
    let (a, b) = (dir.join("a.gguf"), dir.join("b.gguf"));
    quantize(&original, &a, "Q4_0", 1);
    quantize(&original, &b, "Q4_0", 2);
    assert!(
        std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
        "Q4_0 output differs by thread count"
    );
    let listing: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(listing.len(), 2, "left behind: {listing:?}");

    let out = strata()
        .args([
            "run",
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "12",
        ])
        .args(["--threads", "2", "--model"])
        .arg(&a)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("Paris"), "Q4_0 says {stdout:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `strata quantize ARGS`'s one-line error.
fn one_line_error(args: &[&str]) -> String {
    exits_with_one_line(&[&["quantize"], args].concat())
}

#[test]
fn bad_input_gets_one_line_and_a_fix() {
    let original = default_model();
    let original = original.to_str().unwrap();
    let dir = scratch_dir("quantize-errors");
    let out = dir.join("out.gguf");
    let out = out.to_str().unwrap();

    let msg = one_line_error(&["/nonexistent/model.gguf", out, "--type", "Q4_K"]);
    assert!(msg.contains("not found") && msg.contains(".gguf"), "{msg}");

    let msg = one_line_error(&[original, out, "--type", "Q3_K"]);
    assert!(msg.contains("unknown --type") && msg.contains("Q4_K_M"), "{msg}");

    let msg = one_line_error(&[original, original, "--type", "Q8_0"]);
    assert!(msg.contains("input file") && msg.contains("different output"), "{msg}");

    let hf = dir.join("checkpoint");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::write(hf.join("config.json"), "{}").unwrap();
    let msg = one_line_error(&[hf.to_str().unwrap(), out, "--type", "Q8_0"]);
    assert!(msg.contains("HF checkpoint") && msg.contains("convert"), "{msg}");

    let not_gguf = dir.join("notes.txt");
    std::fs::write(&not_gguf, "hello").unwrap();
    one_line_error(&[not_gguf.to_str().unwrap(), out, "--type", "Q8_0"]);

    let msg = one_line_error(&[original, "/nonexistent/dir/out.gguf", "--type", "Q8_0"]);
    assert!(msg.contains("cannot create"), "{msg}");

    assert!(!Path::new(out).exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A llama shape of SmolLM2's vocabulary with 256-wide rows, so every matrix is a K-quant.
const TINY_LLAMA: &str = r#"{
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 49152, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "max_position_embeddings": 2048, "tie_word_embeddings": false
}"#;

#[test]
fn random_weights_take_the_shape_of_a_config_and_the_template_tokenizer() {
    let template = default_model();
    let dir = scratch_dir("quantize-random");
    std::fs::write(dir.join("config.json"), TINY_LLAMA).unwrap();
    let (a, b) = (dir.join("a.gguf"), dir.join("b.gguf"));
    for (out, threads) in [(&a, 1), (&b, 2)] {
        let status = strata()
            .arg("quantize")
            .arg(&template)
            .arg(out)
            .args(["--type", "Q4_K_M", "--seed", "7", "--threads", &threads.to_string()])
            .arg("--random-weights")
            .arg(dir.join("config.json"))
            .output()
            .unwrap();
        assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    }
    assert!(
        std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
        "random weights depend on threads"
    );

    let file = GgufFile::open(&a).unwrap();
    let source = GgufFile::open(&template).unwrap();
    assert_eq!(file.get("tokenizer.ggml.tokens"), source.get("tokenizer.ggml.tokens"));
    assert_eq!(file.get_u64("llama.embedding_length"), Some(256));
    assert_eq!(file.get_u64("llama.block_count"), Some(2));
    assert_eq!(type_of(&file, "token_embd.weight"), GgmlType::Q4K);
    assert_eq!(type_of(&file, "output.weight"), GgmlType::Q6K);
    assert_eq!(type_of(&file, "blk.0.attn_v.weight"), GgmlType::Q4K);
    assert_eq!(type_of(&file, "blk.1.attn_v.weight"), GgmlType::Q6K);
    assert_eq!(type_of(&file, "blk.1.ffn_down.weight"), GgmlType::Q6K);
    assert_eq!(type_of(&file, "blk.0.ffn_gate.weight"), GgmlType::Q4K);
    assert_eq!(type_of(&file, "blk.0.ffn_norm.weight"), GgmlType::F32);

    let model = load_model(&a, &|_, _| {}).unwrap();
    assert_eq!(model.transformer.config.hidden, 256);
    let rows = all_logits(&model);
    assert!(rows.iter().flatten().all(|v| v.is_finite()));
    // Random weights of std 0.02 give small, varied logits, not a constant row.
    let first = &rows[0];
    assert!(first.iter().any(|&v| v != first[0]));

    std::fs::write(dir.join("config.json"), TINY_LLAMA.replace("49152", "1000")).unwrap();
    let msg = one_line_error(&[
        template.to_str().unwrap(),
        dir.join("c.gguf").to_str().unwrap(),
        "--type",
        "Q4_K",
        "--random-weights",
        dir.join("config.json").to_str().unwrap(),
    ]);
    assert!(msg.contains("vocab_size 1000") && msg.contains("template"), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}
