#!/bin/bash
# On the GPU machine: random-weight Llama-3-8B and Qwen2.5-7B checkpoints made with transformers,
# strata's logits and greedy text against transformers' (bf16 and fp8 KV), then speed: strata
# bench-gpu and transformers on the same Llama-3-8B checkpoint. Outputs in $OUT.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
CK=/root/ckpt
mkdir -p "$OUT" "$CK"
for f in gpu-bin/*.gz; do gunzip -kf "$f"; done
chmod +x gpu-bin/strata gpu-bin/cuda-test
T=gpu-bin/tokenizers
cat $CK/llama3-8b/config.json 2>/dev/null | head -c 600; [ -f $CK/llama3-8b/reference.json ] || python3 scripts/gpu/hf_reference.py llama3-8b $CK/llama3-8b $T/llama3 2>&1 | grep -v Warning
[ -f $CK/qwen2.5-7b/reference.json ] || python3 scripts/gpu/hf_reference.py qwen2.5-7b $CK/qwen2.5-7b $T/qwen2.5 2>&1 | grep -v Warning
echo "== fidelity vs transformers"
STRATA_HF_CHECKPOINTS=$CK/llama3-8b:$CK/qwen2.5-7b gpu-bin/cuda-test hf_checkpoints --nocapture 2>&1 | tee "$OUT/fidelity_hf.log" | grep -E "kv|panicked|result"
echo "== strata bench-gpu llama3-8b"
gpu-bin/strata bench-gpu --model $CK/llama3-8b --levels 1,64,256 --prompt-tokens 512 --output-tokens 256 --out "$OUT/gpu_bench_llama3_8b.json" 2>&1 | grep -v "^\s*$" | tail -14 | tee "$OUT/bench_llama3_8b.log"
[ -n "${SKIP_TRANSFORMERS_SPEED:-}" ] || {
echo "== transformers on the same checkpoint"
timeout 150 python3 scripts/gpu/transformers_speed.py $CK/llama3-8b "$OUT/transformers_llama3_8b.json" 64 2>&1 | grep -v -i warn | tail -8
}
echo "== where the time goes (eager steps, each kernel synchronised)"
STRATA_GPU_PROFILE=1 timeout 150 gpu-bin/strata bench-gpu --model $CK/llama3-8b --enforce-eager --levels 1,256 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 64 --decode-tokens 64 --out "$OUT/profile_llama3_8b.json" 2>&1 | grep -A24 "GPU profile" | tee "$OUT/profile_llama3_8b.log"
