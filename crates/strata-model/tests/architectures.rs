//! Every supported architecture against a naive float64 reference written here: tiny random
//! F32 models (GQA, Qwen2 biases, Qwen3 Q/K norms, Llama-3 RoPE factors, tied and untied heads)
//! run as a batch of two sequences over scattered cache blocks, prefill then decode.

#[allow(dead_code)]
mod common;

use std::sync::Arc;

use common::tiny_hf::{add_gguf_hparams, Rng, FFN, HEADS, HIDDEN, KV_HEADS, LAYERS};
use strata_formats::gguf::GgufWriter;
use strata_formats::GgmlType;
use strata_model::kv_cache::KvCacheDtype;
use strata_model::loader::{load_transformer, open_gguf};
use strata_model::{CpuExecutor, Executor, LogitsWanted, PagedKvCache, SeqChunk, Transformer};
use strata_runtime::cpu::ThreadPool;

const HEAD_DIM: usize = 16;
const VOCAB: usize = 50;
const EPS: f64 = 1e-5;
const THETA: f64 = 10000.0;

/// A random model: tensors by GGUF name, values as f32 (row-major, rows = outputs).
struct TinyModel {
    arch: &'static str,
    tensors: Vec<(String, Vec<u64>, Vec<f32>)>,
    tied: bool,
    interleaved_rope: bool,
    freq_factors: Option<Vec<f32>>,
}

impl TinyModel {
    fn new(arch: &'static str, tied: bool, seed: u64) -> TinyModel {
        let mut rng = Rng(seed);
        let (q_dim, kv_dim) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
        let mut t: Vec<(String, Vec<u64>, Vec<f32>)> = Vec::new();
        let mat = |name: &str, rows: usize, cols: usize, rng: &mut Rng| {
            (
                name.to_string(),
                vec![cols as u64, rows as u64],
                rng.vec(rows * cols, 0.3),
            )
        };
        t.push(mat("token_embd.weight", VOCAB, HIDDEN, &mut rng));
        if !tied {
            t.push(mat("output.weight", VOCAB, HIDDEN, &mut rng));
        }
        let norm = |name: String, n: usize, rng: &mut Rng| {
            (
                name,
                vec![n as u64],
                (0..n).map(|_| 1.0 + 0.2 * rng.next()).collect::<Vec<f32>>(),
            )
        };
        t.push(norm("output_norm.weight".into(), HIDDEN, &mut rng));
        for l in 0..LAYERS {
            let n = |s: &str| format!("blk.{l}.{s}");
            t.push(norm(n("attn_norm.weight"), HIDDEN, &mut rng));
            t.push(norm(n("ffn_norm.weight"), HIDDEN, &mut rng));
            t.push(mat(&n("attn_q.weight"), q_dim, HIDDEN, &mut rng));
            t.push(mat(&n("attn_k.weight"), kv_dim, HIDDEN, &mut rng));
            t.push(mat(&n("attn_v.weight"), kv_dim, HIDDEN, &mut rng));
            t.push(mat(&n("attn_output.weight"), HIDDEN, q_dim, &mut rng));
            t.push(mat(&n("ffn_gate.weight"), FFN, HIDDEN, &mut rng));
            t.push(mat(&n("ffn_up.weight"), FFN, HIDDEN, &mut rng));
            t.push(mat(&n("ffn_down.weight"), HIDDEN, FFN, &mut rng));
            if arch == "qwen2" {
                for (b, len) in [("attn_q.bias", q_dim), ("attn_k.bias", kv_dim), ("attn_v.bias", kv_dim)] {
                    t.push((n(b), vec![len as u64], rng.vec(len, 0.5)));
                }
            }
            if arch == "qwen3" {
                t.push(norm(n("attn_q_norm.weight"), HEAD_DIM, &mut rng));
                t.push(norm(n("attn_k_norm.weight"), HEAD_DIM, &mut rng));
            }
        }
        let freq_factors =
            (arch == "llama").then(|| (0..HEAD_DIM / 2).map(|i| 1.0 + i as f32 * 0.5).collect::<Vec<_>>());
        if let Some(ff) = &freq_factors {
            t.push(("rope_freqs.weight".into(), vec![ff.len() as u64], ff.clone()));
        }
        TinyModel {
            arch,
            tensors: t,
            tied,
            interleaved_rope: matches!(arch, "llama" | "mistral"),
            freq_factors,
        }
    }

    fn get(&self, name: &str) -> Option<&[f32]> {
        self.tensors.iter().find(|t| t.0 == name).map(|t| &t.2[..])
    }

    fn write(&self, path: &std::path::Path) {
        let mut w = GgufWriter::new();
        add_gguf_hparams(&mut w, self.arch, HEAD_DIM, VOCAB, THETA as f32, EPS as f32);
        for (name, dims, data) in &self.tensors {
            let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            w.add_tensor(name.clone(), dims, GgmlType::F32, bytes).unwrap();
        }
        std::fs::write(path, w.to_bytes()).unwrap();
    }

    /// Logits at every position of `tokens`, by the book, in f64.
    fn reference(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let g = |n: &str| {
            self.get(n)
                .unwrap_or_else(|| panic!("{n}"))
                .iter()
                .map(|&v| v as f64)
                .collect::<Vec<f64>>()
        };
        let matvec = |w: &[f64], x: &[f64]| -> Vec<f64> {
            w.chunks_exact(x.len())
                .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
                .collect()
        };
        let rms = |x: &[f64], w: &[f64]| -> Vec<f64> {
            let s = (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + EPS).sqrt();
            x.iter().zip(w).map(|(v, w)| v / s * w).collect()
        };
        let rope = |v: &mut [f64], pos: usize| {
            let half = HEAD_DIM / 2;
            for head in v.chunks_exact_mut(HEAD_DIM) {
                for i in 0..half {
                    let mut f = THETA.powf(-2.0 * i as f64 / HEAD_DIM as f64);
                    if let Some(ff) = &self.freq_factors {
                        f /= ff[i] as f64;
                    }
                    let (c, s) = ((pos as f64 * f).cos(), (pos as f64 * f).sin());
                    let (a, b) = if self.interleaved_rope {
                        (2 * i, 2 * i + 1)
                    } else {
                        (i, i + half)
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * c - x1 * s;
                    head[b] = x0 * s + x1 * c;
                }
            }
        };
        let embd = g("token_embd.weight");
        let mut xs: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| embd[t as usize * HIDDEN..(t as usize + 1) * HIDDEN].to_vec())
            .collect();
        for l in 0..LAYERS {
            let n = |s: &str| format!("blk.{l}.{s}");
            let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
            for (pos, x) in xs.iter().enumerate() {
                let h = rms(x, &g(&n("attn_norm.weight")));
                let (mut q, mut k, mut v) = (
                    matvec(&g(&n("attn_q.weight")), &h),
                    matvec(&g(&n("attn_k.weight")), &h),
                    matvec(&g(&n("attn_v.weight")), &h),
                );
                if self.arch == "qwen2" {
                    for (t, b) in [
                        (&mut q, "attn_q.bias"),
                        (&mut k, "attn_k.bias"),
                        (&mut v, "attn_v.bias"),
                    ] {
                        t.iter_mut().zip(g(&n(b))).for_each(|(a, b)| *a += b);
                    }
                }
                if self.arch == "qwen3" {
                    let (qn, kn) = (g(&n("attn_q_norm.weight")), g(&n("attn_k_norm.weight")));
                    q = q.chunks_exact(HEAD_DIM).flat_map(|hd| rms(hd, &qn)).collect();
                    k = k.chunks_exact(HEAD_DIM).flat_map(|hd| rms(hd, &kn)).collect();
                }
                rope(&mut q, pos);
                rope(&mut k, pos);
                qs.push(q);
                ks.push(k);
                vs.push(v);
            }
            for (i, x) in xs.iter_mut().enumerate() {
                let mut att = vec![0.0; HEADS * HEAD_DIM];
                for h in 0..HEADS {
                    let kvh = h / (HEADS / KV_HEADS);
                    let qh = &qs[i][h * HEAD_DIM..(h + 1) * HEAD_DIM];
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| {
                            qh.iter().zip(&ks[j][kvh * HEAD_DIM..]).map(|(a, b)| a * b).sum::<f64>()
                                / (HEAD_DIM as f64).sqrt()
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = sc.iter().map(|s| (s - mx).exp()).sum();
                    for (j, s) in sc.iter().enumerate() {
                        let p = (s - mx).exp() / z;
                        for d in 0..HEAD_DIM {
                            att[h * HEAD_DIM + d] += p * vs[j][kvh * HEAD_DIM + d];
                        }
                    }
                }
                let o = matvec(&g(&n("attn_output.weight")), &att);
                x.iter_mut().zip(o).for_each(|(a, b)| *a += b);
                let h = rms(x, &g(&n("ffn_norm.weight")));
                let (gt, up) = (
                    matvec(&g(&n("ffn_gate.weight")), &h),
                    matvec(&g(&n("ffn_up.weight")), &h),
                );
                let act: Vec<f64> = gt.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                let d = matvec(&g(&n("ffn_down.weight")), &act);
                x.iter_mut().zip(d).for_each(|(a, b)| *a += b);
            }
        }
        let head = if self.tied {
            g("token_embd.weight")
        } else {
            g("output.weight")
        };
        xs.iter()
            .map(|x| matvec(&head, &rms(x, &g("output_norm.weight"))))
            .collect()
    }
}

fn load(model: &TinyModel, name: &str) -> Transformer {
    let dir = std::env::temp_dir().join(format!("strata-arch-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.gguf"));
    model.write(&path);
    let t = load_transformer(Arc::clone(&open_gguf(&path).unwrap()), &|_, _| {}).unwrap();
    std::fs::remove_file(&path).unwrap();
    t
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (&g, &w)| m.max((g as f64 - w).abs()));
    assert!(err / scale < 1e-4, "{what}: max error {err} (scale {scale})");
}

fn check_arch(arch: &'static str, tied: bool, seed: u64) {
    let model = TinyModel::new(arch, tied, seed);
    let t = load(&model, arch);
    assert_eq!(t.config.tied_embeddings, tied);
    let pool = ThreadPool::new(2);
    let mut kv = PagedKvCache::new(&t.config, KvCacheDtype::Auto, 4, 8);
    let a: Vec<u32> = vec![3, 17, 42, 8, 8, 1, 30, 49, 12];
    let b: Vec<u32> = vec![5, 6, 7, 44, 2];
    let (ta, tb) = (vec![6u32, 1, 3], vec![0u32, 7]);
    let mut scratch = Default::default();
    // Prefill both (a in two chunks: 5 then 4), logits everywhere.
    let batch = [
        SeqChunk {
            tokens: a[..5].to_vec(),
            first_pos: 0,
            block_table: ta.clone(),
            logits: LogitsWanted::All,
            prompt_len: usize::MAX,
            adjust: None,
        },
        SeqChunk {
            tokens: b.clone(),
            first_pos: 0,
            block_table: tb.clone(),
            logits: LogitsWanted::All,
            prompt_len: usize::MAX,
            adjust: None,
        },
    ];
    let l1 = t.forward(&batch, &mut kv, &pool, &mut scratch).unwrap();
    let batch = [SeqChunk {
        tokens: a[5..].to_vec(),
        first_pos: 5,
        block_table: ta.clone(),
        logits: LogitsWanted::All,
        prompt_len: usize::MAX,
        adjust: None,
    }];
    let l2 = t.forward(&batch, &mut kv, &pool, &mut scratch).unwrap();
    let ra = model.reference(&a);
    let rb = model.reference(&b);
    for (i, want) in ra.iter().take(5).enumerate() {
        assert_close(l1.row(i), want, &format!("{arch} seq a prefill pos {i}"));
    }
    for (i, want) in rb.iter().enumerate() {
        assert_close(l1.row(5 + i), want, &format!("{arch} seq b prefill pos {i}"));
    }
    for i in 0..4 {
        assert_close(
            l2.row(i),
            &ra[5 + i],
            &format!("{arch} seq a second chunk pos {}", 5 + i),
        );
    }
    // One decode step for both, in one batch.
    let (na, nb) = (11u32, 23u32);
    let batch = [
        SeqChunk {
            tokens: vec![na],
            first_pos: a.len(),
            block_table: ta,
            logits: LogitsWanted::Last,
            prompt_len: a.len(),
            adjust: None,
        },
        SeqChunk {
            tokens: vec![nb],
            first_pos: b.len(),
            block_table: tb,
            logits: LogitsWanted::Last,
            prompt_len: b.len(),
            adjust: None,
        },
    ];
    let l3 = t.forward(&batch, &mut kv, &pool, &mut scratch).unwrap();
    let ra = model.reference(&[a, vec![na]].concat());
    let rb = model.reference(&[b, vec![nb]].concat());
    assert_close(l3.last_of(0).unwrap(), ra.last().unwrap(), &format!("{arch} decode a"));
    assert_close(l3.last_of(1).unwrap(), rb.last().unwrap(), &format!("{arch} decode b"));
}

#[test]
fn llama_with_llama3_rope_factors_and_tied_head() {
    check_arch("llama", true, 1);
}

#[test]
fn mistral_untied() {
    check_arch("mistral", false, 2);
}

#[test]
fn qwen2_with_qkv_bias() {
    check_arch("qwen2", false, 3);
}

#[test]
fn qwen3_with_qk_norm() {
    check_arch("qwen3", true, 4);
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let model = TinyModel::new("llama", true, 5);
    let t = load(&model, "llama-bad");
    let pool = ThreadPool::new(1);
    let mut kv = PagedKvCache::new(&t.config, KvCacheDtype::Auto, 4, 2);
    let mut scratch = Default::default();
    let cases = [
        (
            SeqChunk {
                tokens: vec![VOCAB as u32],
                first_pos: 0,
                block_table: vec![0],
                logits: LogitsWanted::Last,
                prompt_len: usize::MAX,
                adjust: None,
            },
            "vocabulary",
        ),
        (
            SeqChunk {
                tokens: vec![1; 5],
                first_pos: 0,
                block_table: vec![0],
                logits: LogitsWanted::Last,
                prompt_len: usize::MAX,
                adjust: None,
            },
            "block table",
        ),
        (
            SeqChunk {
                tokens: vec![1],
                first_pos: 0,
                block_table: vec![9],
                logits: LogitsWanted::Last,
                prompt_len: usize::MAX,
                adjust: None,
            },
            "outside the cache",
        ),
    ];
    for (chunk, want) in cases {
        let err = t
            .forward(&[chunk], &mut kv, &pool, &mut scratch)
            .map(|_| ())
            .expect_err("must fail");
        assert!(err.to_string().contains(want), "{err}");
    }
}

/// The CPU executor's one protocol: batches submitted come back from `collect` in order, each as
/// `forward` (submit then collect) gives it; tokens from the device and a collect with nothing
/// submitted are refused with a clear error.
#[test]
fn the_cpu_executor_collects_in_submission_order() {
    let model = TinyModel::new("llama", true, 9);
    let chunk = |tokens: Vec<u32>, block: u32| SeqChunk {
        tokens,
        first_pos: 0,
        block_table: vec![block, block + 1],
        logits: LogitsWanted::Last,
        prompt_len: usize::MAX,
        adjust: None,
    };
    let (a, b) = (chunk(vec![3, 17, 42], 0), chunk(vec![5, 6], 2));
    let mut once = CpuExecutor::new(load(&model, "llama-once"), KvCacheDtype::Auto, 4, 4, 1);
    let want_a = once.forward(std::slice::from_ref(&a)).unwrap();
    let want_b = once.forward(std::slice::from_ref(&b)).unwrap();
    let mut exec = CpuExecutor::new(load(&model, "llama-queued"), KvCacheDtype::Auto, 4, 4, 1);
    exec.submit(vec![a.clone()], None).unwrap();
    exec.submit(vec![b.clone()], None).unwrap();
    assert_eq!(exec.collect().unwrap().data, want_a.data);
    assert_eq!(exec.collect().unwrap().data, want_b.data);
    assert_ne!(want_a.data, want_b.data);
    let err = exec.collect().unwrap_err().to_string();
    assert!(err.contains("no batch submitted"), "{err}");
    let err = exec.submit(vec![a], Some(vec![0])).unwrap_err().to_string();
    assert!(err.contains("tokens_from"), "{err}");
}
