//! attention.cu's tensor-core and staged kernels, split over context parts or not, against the
//! CUDA-core kernel, on bf16 and fp8 caches; the prompt kernels' tiles of query tokens against it
//! on both.

use strata_runtime::cuda::kernels::STAGED_ATTENTION_MAX_STAGES;
use strata_runtime::cuda::{prompt_tiles, AttentionCall, DeviceBuffer, Gpu, KernelSpec, Kernels, PrefillAttentionCall};

use crate::common::{bf16_value, first_gpu, random_bf16, read_bf16};

/// The cache of one attention test: K and V (bf16, or fp8 e4m3 with a scale per vector).
struct TestCache {
    k: DeviceBuffer,
    v: DeviceBuffer,
    scales: Option<(DeviceBuffer, DeviceBuffer)>,
}

/// A bf16 cache and an fp8 one of `vectors` random K and V vectors each (seeds from `seed` on).
/// fp8: random e4m3 bytes with the exponent's top bit clear (|x| < 2, no NaN codes), scales in
/// [0.5, 1.5).
fn random_caches(gpu: &Gpu, vectors: usize, head_dim: usize, seed: u64) -> [TestCache; 2] {
    let len = vectors * head_dim;
    let fp8 = |seed| -> Vec<u8> { random_bf16(len, seed).iter().map(|b| (b >> 3) as u8 & 0xbf).collect() };
    let scales = |seed| -> Vec<f32> {
        random_bf16(vectors, seed)
            .iter()
            .map(|&b| 1.0 + 0.5 * bf16_value(b))
            .collect()
    };
    [
        TestCache {
            k: gpu.upload(&random_bf16(len, seed), "k").unwrap(),
            v: gpu.upload(&random_bf16(len, seed + 1), "v").unwrap(),
            scales: None,
        },
        TestCache {
            k: gpu.upload(&fp8(seed + 2), "k").unwrap(),
            v: gpu.upload(&fp8(seed + 3), "v").unwrap(),
            scales: Some((
                gpu.upload(&scales(seed + 4), "k scales").unwrap(),
                gpu.upload(&scales(seed + 5), "v scales").unwrap(),
            )),
        },
    ]
}

/// The call of one test's attention over `cache` and the queries into `out`, its context parts
/// merged through `(part_acc, part_ml)` (0 for none).
fn test_call(
    (head_dim, group, n_kv, block_size): (usize, usize, usize, usize),
    cache: &TestCache,
    (q, tables, token_seq, positions): (&DeviceBuffer, &DeviceBuffer, &DeviceBuffer, &DeviceBuffer),
    (tokens, max_blocks, parts): (usize, usize, usize),
    stages: usize,
    out: &DeviceBuffer,
    (part_acc, part_ml): (u64, u64),
) -> AttentionCall {
    let n_heads = n_kv * group;
    let (k_scale, v_scale) = cache.scales.as_ref().map_or((0, 0), |(k, v)| (k.ptr(), v.ptr()));
    AttentionCall {
        q: q.ptr(),
        q_stride: (n_heads * head_dim) as i32,
        k_cache: cache.k.ptr(),
        v_cache: cache.v.ptr(),
        k_scale,
        v_scale,
        block_tables: tables.ptr(),
        max_blocks: max_blocks as i32,
        token_seq: token_seq.ptr(),
        positions: positions.ptr(),
        out: out.ptr(),
        part_acc,
        part_ml,
        n_kv: n_kv as i32,
        block_size: block_size as i32,
        scale: 0.3,
        stages: stages as i32,
        tokens,
        parts: parts as i32,
        n_heads,
        head_dim,
        fp8: cache.scales.is_some(),
    }
}

/// Runs one attention kernel (and the part merge when `parts` > 1) over the given cache and
/// queries; returns the bf16 output as f32.
#[allow(clippy::too_many_arguments)]
fn run_attention(
    gpu: &Gpu,
    kernels: &Kernels,
    kernel: &str,
    shape: (usize, usize, usize, usize),
    cache: &TestCache,
    bufs: (&DeviceBuffer, &DeviceBuffer, &DeviceBuffer, &DeviceBuffer),
    (tokens, max_blocks, parts): (usize, usize, usize),
    stages: usize,
) -> Vec<f32> {
    let (head_dim, group, n_kv, _) = shape;
    let n_heads = n_kv * group;
    let width = n_heads * head_dim;
    let out = gpu.alloc(tokens * width * 2, "out").unwrap();
    let part_acc = gpu.alloc(tokens * n_heads * parts * head_dim * 4, "partials").unwrap();
    let part_ml = gpu.alloc(tokens * n_heads * parts * 2 * 4, "partials").unwrap();
    let call = test_call(
        shape,
        cache,
        bufs,
        (tokens, max_blocks, parts),
        stages,
        &out,
        (part_acc.ptr(), part_ml.ptr()),
    );
    // SAFETY: buffers sized by the caller for these shapes.
    unsafe { call.launch(gpu, kernels, kernel) }.unwrap();
    read_bf16(gpu, &out, tokens * width)
}

#[test]
fn tensor_core_attention_matches_the_cuda_core_kernel() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let n_kv = 2usize;
    // SmolLM2's heads (64 wide, 3 per KV head) and Llama-3's (128, 4) and Qwen2.5-7B's (128, 7).
    for (head_dim, group) in [(64usize, 3usize), (128, 4), (128, 7)] {
        let kernels = Kernels::load(&gpu, KernelSpec { head_dim, group }).unwrap();
        // Blocks of 16 keys hold a staged tile each; blocks of 8 split every tile in two.
        for block_size in [16usize, 8] {
            let (num_blocks, max_blocks) = (1280 / block_size, 640 / block_size);
            check_tensor_core_attention(
                &gpu,
                &kernels,
                (head_dim, group, n_kv, block_size),
                (num_blocks, max_blocks),
            );
        }
    }
}

fn check_tensor_core_attention(
    gpu: &Gpu,
    kernels: &Kernels,
    shape: (usize, usize, usize, usize),
    (num_blocks, max_blocks): (usize, usize),
) {
    let (head_dim, group, n_kv, block_size) = shape;
    let [bf16_cache, fp8_cache] = random_caches(gpu, num_blocks * n_kv * block_size, head_dim, 11);
    // Contexts that end mid-block, on a block edge, in the first key, and long ones; each
    // sequence's blocks are scattered over the cache.
    let contexts = [1usize, 5, 16, 17, 100, 333, 512, 639];
    let mut tables = vec![0i32; contexts.len() * max_blocks];
    for (si, row) in tables.chunks_mut(max_blocks).enumerate() {
        for (b, slot) in row.iter_mut().enumerate() {
            *slot = ((b * 37 + si * 11) % num_blocks) as i32;
        }
    }
    let positions: Vec<i32> = contexts.iter().map(|&c| c as i32 - 1).collect();
    let token_seq: Vec<i32> = (0..contexts.len() as i32).collect();
    let tokens = contexts.len();
    let q = gpu
        .upload(&random_bf16(tokens * n_kv * group * head_dim, 13), "q")
        .unwrap();
    let (tb, ts, ps) = (
        gpu.upload(&tables, "tables").unwrap(),
        gpu.upload(&token_seq, "token_seq").unwrap(),
        gpu.upload(&positions, "positions").unwrap(),
    );
    let bufs = (&q, &tb, &ts, &ps);
    for (cache, simt, mma, staged) in [
        (
            &bf16_cache,
            "paged_attention_bf16",
            "paged_attention_mma_bf16",
            "paged_attention_staged_bf16",
        ),
        (
            &fp8_cache,
            "paged_attention_fp8",
            "paged_attention_mma_fp8",
            "paged_attention_staged_fp8",
        ),
    ] {
        let want = run_attention(gpu, kernels, simt, shape, cache, bufs, (tokens, max_blocks, 1), 0);
        let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut variants = vec![(mma, 0usize, 1usize), (mma, 0, 3), (mma, 0, 16)];
        variants.extend((2..=STAGED_ATTENTION_MAX_STAGES).flat_map(|st| [(staged, st, 1), (staged, st, 3)]));
        for (kernel, stages, parts) in variants {
            let got = run_attention(
                gpu,
                kernels,
                kernel,
                shape,
                cache,
                bufs,
                (tokens, max_blocks, parts),
                stages,
            );
            let width = n_kv * group * head_dim;
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                // P is rounded to bf16 (f16 for fp8) before P·V on tensor cores; outputs are
                // bf16 either way.
                assert!(
                    (a - b).abs() <= 4e-3 * largest + 1e-2 * b.abs(),
                    "{kernel} ({stages} stages) head_dim {head_dim} group {group} block size {block_size} parts {parts}: token {} (context {}) element {}: {a} vs {simt} {b}",
                    i / width,
                    contexts[i / width],
                    i % width
                );
            }
            if stages > 0 {
                // Staging changes where the tiles come from, not what is computed.
                let unstaged = run_attention(gpu, kernels, mma, shape, cache, bufs, (tokens, max_blocks, parts), 0);
                assert_eq!(
                    got, unstaged,
                    "{kernel} ({stages} stages, block size {block_size}, parts {parts}) vs {mma}"
                );
            }
        }
    }
}

#[test]
fn prompt_tiles_attend_as_the_cuda_core_kernel() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let n_kv = 2usize;
    // Chunks as a prompt step mixes them: (tokens, first position). A decode, a whole prompt
    // cut 16 + 16 + 8, a chunk that starts mid-prompt, one that starts mid-tile of a cache
    // block, a one-tile prompt, and a long late chunk.
    let chunks = [(1usize, 600usize), (40, 0), (16, 100), (23, 301), (5, 7), (70, 560)];
    let tokens: usize = chunks.iter().map(|c| c.0).sum();
    let (mut positions, mut token_seq) = (Vec::new(), Vec::new());
    for (si, &(len, first)) in chunks.iter().enumerate() {
        positions.extend((first..first + len).map(|p| p as i32));
        token_seq.extend(std::iter::repeat_n(si as i32, len));
    }
    let tiles = prompt_tiles(chunks);
    for (head_dim, group) in [(64usize, 3usize), (128, 4), (128, 7)] {
        let kernels = Kernels::load(&gpu, KernelSpec { head_dim, group }).unwrap();
        for block_size in [16usize, 8] {
            let (num_blocks, max_blocks) = (1280 / block_size, 640 / block_size);
            let caches = random_caches(&gpu, num_blocks * n_kv * block_size, head_dim, 31);
            let mut tables = vec![0i32; chunks.len() * max_blocks];
            for (si, row) in tables.chunks_mut(max_blocks).enumerate() {
                for (b, slot) in row.iter_mut().enumerate() {
                    *slot = ((b * 29 + si * 13) % num_blocks) as i32;
                }
            }
            let width = n_kv * group * head_dim;
            let q = gpu.upload(&random_bf16(tokens * width, 33), "q").unwrap();
            let (tb, ts, ps, tl) = (
                gpu.upload(&tables, "tables").unwrap(),
                gpu.upload(&token_seq, "token_seq").unwrap(),
                gpu.upload(&positions, "positions").unwrap(),
                gpu.upload(&tiles, "tiles").unwrap(),
            );
            let shape = (head_dim, group, n_kv, block_size);
            let bufs = (&q, &tb, &ts, &ps);
            for (cache, simt) in caches.iter().zip(["paged_attention_bf16", "paged_attention_fp8"]) {
                let want = run_attention(&gpu, &kernels, simt, shape, cache, bufs, (tokens, max_blocks, 1), 0);
                let out = gpu.alloc(tokens * width * 2, "out").unwrap();
                let call = PrefillAttentionCall {
                    attention: test_call(shape, cache, bufs, (tokens, max_blocks, 1), 0, &out, (0, 0)),
                    tiles: tl.ptr(),
                    n_tiles: tiles.len(),
                };
                // SAFETY: buffers sized above; each tile's tokens are one chunk's, positions consecutive.
                unsafe { call.launch(&gpu, &kernels) }.unwrap();
                let got = read_bf16(&gpu, &out, tokens * width);
                let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(largest > 0.0, "the reference attended to nothing");
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    // P is rounded to bf16 (f16 for fp8) before P·V on tensor cores; outputs
                    // are bf16 either way.
                    assert!(
                        (a - b).abs() <= 4e-3 * largest + 1e-2 * b.abs(),
                        "{}, head_dim {head_dim} group {group} block size {block_size}: token {} \
                         (position {}) element {}: {a} vs {simt} {b}",
                        call.kernel(),
                        i / width,
                        positions[i / width],
                        i % width
                    );
                }
            }
        }
    }
}
