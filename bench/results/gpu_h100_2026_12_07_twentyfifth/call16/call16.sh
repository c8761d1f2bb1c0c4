#!/usr/bin/env bash
# Twenty-fifth sitting, third call (the machine of calls 14 and 15, warm): the default model's last
# parts staged (model.gz.partab carried beside cuda-test.gz; partaa came in call 14, partac in 15), SmolLM2 re-quantized to Q4_K_M by
# the strata build call 14 kept, then the long-prompt GPU tests, by default and under QWIDE_DEEP=1.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call16
pack_every 10
bash scripts/gpu/stage_model.sh | tee "$OUT/stage.log"
QM=/root/smollm2-quant
mkdir -p $QM
timeout 120 /root/keep/strata quantize "${STRATA_CACHE:-$HOME/.cache/strata}/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
    $QM/smollm2-Q4_K_M.gguf --type Q4_K_M > "$OUT/quantize.log" 2>&1 || tail -3 "$OUT/quantize.log"
for defines in "" QWIDE_DEEP=1; do
    echo "== long-prompt GPU tests${defines:+, $defines} (t=$SECONDS)"
    env ${defines:+STRATA_KERNEL_DEFINES=$defines} STRATA_QUANT_MODELS=$QM timeout 150 gpu-bin/cuda-test --nocapture \
        --test-threads 1 a_long_prompt > "$OUT/cuda_test_long_prompt${defines:+_deep}.log" 2>&1
    grep -hE "^test |panicked|test result|vs CPU|worst|top-1" "$OUT/cuda_test_long_prompt${defines:+_deep}.log" | cut -c1-300
done
echo "end t=$SECONDS"
packer_stop
