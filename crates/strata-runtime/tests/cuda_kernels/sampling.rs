//! sampling.cu on a GPU: the argmax of `argmax_slices` and `argmax_merge` is the CPU's, and
//! `apply_row_adjust` masks and biases rows exactly as the host sampler does, on a whole
//! vocabulary and on a TP shard's slice. (Sampled rows are strata-model's tests/cuda.rs: they
//! are checked against the host sampler's own rule.)

use strata_runtime::cuda::sampling_call::ARGMAX_SLICES;
use strata_runtime::cuda::{ChooseTokensCall, Gpu, KernelSpec, Kernels, RowAdjustCall, RowAdjustSlot};

use crate::common::{bf16_value, first_gpu, random_bf16};

/// Each row's argmax id and its logit by `argmax_slices` and `argmax_merge` (no sampling).
fn argmax_on_the_gpu(gpu: &Gpu, kernels: &Kernels, logits: &[f32], vocab: usize) -> (Vec<u32>, Vec<f32>) {
    let rows = logits.len() / vocab;
    let dev = gpu.upload(logits, "logits").unwrap();
    let parts = gpu.alloc(2 * rows * ARGMAX_SLICES * 4, "parts").unwrap();
    let out = gpu.alloc(2 * rows * 4, "ids").unwrap();
    let call = ChooseTokensCall {
        logits: dev.ptr(),
        vocab: vocab as i32,
        sampling: 0,
        limits: 0,
        part_vals: parts.ptr(),
        part_ids: parts.at(rows * ARGMAX_SLICES * 4),
        ids: out.ptr(),
        vals: out.at(rows * 4),
        vocab_start: 0,
        rows,
    };
    // SAFETY: buffers sized as above; no sampling parameters, so no limits are read.
    unsafe { call.launch(gpu, kernels) }.unwrap();
    let mut got = vec![0u32; 2 * rows];
    gpu.read(&out, 0, &mut got).unwrap();
    let values = got[rows..].iter().map(|&b| f32::from_bits(b)).collect();
    got.truncate(rows);
    (got, values)
}

#[test]
fn argmax_on_the_gpu_matches_the_cpu() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    // A vocabulary smaller than the slices, SmolLM2's, Llama-3's, Qwen2.5's.
    for vocab in [17usize, 49152, 128256, 151936] {
        let rows = 5;
        let mut logits: Vec<f32> = random_bf16(rows * vocab, vocab as u64)
            .into_iter()
            .map(bf16_value)
            .collect();
        // Row 1: the maximum twice, in two slices (the lower id wins); row 2: every logit -inf
        // but a NaN (id 0 of the -inf ones); row 3: a NaN beside the maximum; row 4: all equal.
        let r = |i: usize, c: usize| i * vocab + c;
        logits[r(1, vocab - 1)] = 5.0;
        logits[r(1, vocab / 3)] = 5.0;
        logits[r(2, 0)..r(3, 0)].fill(f32::NEG_INFINITY);
        logits[r(2, vocab / 2)] = f32::NAN;
        logits[r(3, 1)] = f32::NAN;
        logits[r(3, vocab - 2)] = 7.0;
        logits[r(4, 0)..r(5, 0)].fill(0.25);
        let want: Vec<u32> = (0..rows)
            .map(|i| {
                let row = &logits[r(i, 0)..r(i + 1, 0)];
                // The CPU's rule with NaN never chosen: the first of the largest.
                let mut best = 0;
                while best < vocab && row[best].is_nan() {
                    best += 1;
                }
                for (c, &v) in row.iter().enumerate() {
                    if v > row[best] {
                        best = c;
                    }
                }
                best as u32
            })
            .collect();
        let (ids, values) = argmax_on_the_gpu(&gpu, &kernels, &logits, vocab);
        assert_eq!(&ids, &want, "vocab {vocab}: argmax ids");
        for i in 0..rows {
            assert_eq!(
                values[i],
                logits[r(i, want[i] as usize)],
                "vocab {vocab} row {i}: the argmax's logit"
            );
        }
    }
}

/// The host rule: bias, then every id outside the mask (or past it) at -inf.
fn reference(row: &[f32], vocab_start: usize, mask: Option<&[u32]>, bias: &[(u32, f32)]) -> Vec<f32> {
    let mut out = row.to_vec();
    for &(id, b) in bias {
        if let Some(l) = (id as usize).checked_sub(vocab_start).and_then(|i| out.get_mut(i)) {
            *l += b;
        }
    }
    if let Some(mask) = mask {
        for (i, l) in out.iter_mut().enumerate() {
            let id = vocab_start + i;
            if mask.get(id / 32).is_none_or(|w| w >> (id % 32) & 1 == 0) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    out
}

#[test]
fn masks_and_biases_match_the_host_rule() {
    let Some(gpu) = first_gpu() else { return };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).expect("kernels compile");
    let full_vocab = 1000usize;
    let slot = RowAdjustSlot::for_vocab(full_vocab - 10, 4); // ids 990.. are past the mask
                                                             // Whole vocabulary, and the second half as a TP shard would hold it.
    for (vocab_start, vocab) in [(0usize, full_vocab), (500, 500)] {
        let rows = 4;
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 7919) % 997) as f32 / 100.0 - 5.0)
            .collect();
        let mask: Vec<u32> = (0..slot.mask_words)
            .map(|w| 0x9249_2492u32.rotate_left(w as u32))
            .collect();
        let bias = [(3u32, 2.5f32), (700, -1.0), (999, 4.0), (6, 100.0)];
        // Row 0: mask and bias; row 1: bias only; row 2: none; row 3: mask only.
        let row_slot = [0i32, 1, -1, 2];
        let mut slots = vec![0u32; 3 * slot.words()];
        let (s0, rest) = slots.split_at_mut(slot.words());
        let (s1, s2) = rest.split_at_mut(slot.words());
        slot.write_bias(s0, &bias);
        slot.mask_mut(s0).copy_from_slice(&mask);
        slot.set_masked(s0, true);
        slot.write_bias(s1, &bias);
        slot.write_bias(s2, &[]);
        slot.mask_mut(s2).copy_from_slice(&mask);
        slot.set_masked(s2, true);
        let d_logits = gpu.upload(&logits, "logits").expect("upload");
        let d_row_slot = gpu.upload(&row_slot, "row slots").expect("upload");
        let d_slots = gpu.upload(&slots, "slots").expect("upload");
        let call = RowAdjustCall {
            logits: d_logits.ptr(),
            vocab: vocab as i32,
            row_slot: d_row_slot.ptr(),
            slots: d_slots.ptr(),
            mask_words: slot.mask_words as i32,
            max_bias: slot.max_bias as i32,
            vocab_start: vocab_start as i32,
            rows,
        };
        // SAFETY: the buffers above hold `rows` rows and three slots of this layout.
        unsafe { call.launch(&gpu, &kernels) }.expect("launches");
        let mut got = vec![0f32; rows * vocab];
        gpu.read(&d_logits, 0, &mut got).expect("reads back");
        let want: Vec<f32> = [
            (Some(&mask[..]), &bias[..]),
            (None, &bias[..]),
            (None, &[][..]),
            (Some(&mask[..]), &[][..]),
        ]
        .iter()
        .enumerate()
        .flat_map(|(r, &(m, b))| reference(&logits[r * vocab..(r + 1) * vocab], vocab_start, m, b))
        .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "vocabulary slice from {vocab_start}");
        println!("apply_row_adjust matches the host rule on {vocab} ids from {vocab_start}");
    }
}
