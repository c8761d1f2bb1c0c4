#!/usr/bin/env bash
# Multi-GPU execution on the 2-GPU machine, one phase per device call (outputs in $OUT):
#   correct  random Llama-3-8B (transformers): TP 2 and PP 2 against one GPU (greedy 64 tokens, logits),
#            with and without --deterministic (tests, then `strata run` on each layout), a stalled
#            rank failing within the deadline, and then `stall`
#   stall    a server whose rank stalls answering 503, and exiting cleanly on SIGTERM afterwards
#   fast     topo --measure, plan, and bench-gpu of forced TP 2 (the plan here), PP 2 and one GPU (NVLink)
#   slow     topo --measure, plan, and bench-gpu of the auto plan and forced TP 2 with NCCL over sockets
#            (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
#   seeds    Qwen2.5-32B-shaped random weights served under the auto plan; strata bench, 20 users, 512 in / 1024 out:
#            all 20 arriving at once (closed loop), and arriving as a Poisson stream capped at 20 in flight
# Carries gpu-bin/ (strata.gz, multi-gpu-test.gz, tokenizers-llama3.tgz, tokenizers-qwen2.5.tgz); no Rust toolchain, no network.
# multi-gpu-test.gz is strata-parallel's multi_gpu test binary (`cargo test --release -p strata-parallel
# --features cuda --test multi_gpu --no-run`), executable and gzipped.
set -u
PHASE=${1:?phase: correct | stall | fast | slow | seeds}
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
make_ckpt() { # ARCH DIR TOKENIZER
    [ -f "$2/reference.json" ] || python3 scripts/gpu/hf_reference.py "$1" "$2" "gpu-bin/tokenizers/$3" --prompts-only 2>&1 | grep -v -i warn
}
llama3_8b_checkpoint

case $PHASE in
correct)
    echo "== TP 2 and PP 2 against one GPU; a stalled rank"
    STRATA_HF_CHECKPOINTS=$L8 timeout 420 gpu-bin/multi-gpu-test --nocapture --test-threads=1 2>&1 |
        tee "$OUT/multi_gpu_test.log" | grep -E "vs one GPU|vs cuBLAS|after|test result|panicked|skipped|not applicable|assert"
    echo "== strata run --deterministic on one GPU, TP 2 and PP 2: 64 greedy tokens each"
    for l in "one:--device cuda:0" "tp2:--device cuda --tensor-parallel-size 2" "pp2:--device cuda --pipeline-parallel-size 2"; do
        # shellcheck disable=SC2086
        $S run --model "$L8" ${l#*:} --deterministic --prompt "The capital of France is" \
            --max-tokens 64 --ignore-eos > "$OUT/deterministic_${l%%:*}.txt" 2> "$OUT/deterministic_${l%%:*}.err"
        echo "${l%%:*}: exit $? $(md5sum < "$OUT/deterministic_${l%%:*}.txt" | cut -c1-12) $(grep -o '[0-9.]* tok/s' "$OUT/deterministic_${l%%:*}.err" | tail -1)"
    done
    bash "$0" stall
    ;;
stall)
    echo "== server: rank 1 stops responding at step 40 (--collective-timeout 5)"
    STRATA_FAULT_STALL=1:40 $S serve --model "$L8" --device cuda --tensor-parallel-size 2 --collective-timeout 5 \
        --port 8031 --max-model-len 4096 > "$OUT/stall_serve.log" 2>&1 &
    pid=$!
    if wait_up 8031; then
        t0=$(date +%s%N)
        curl -s -o "$OUT/stall_completion.json" -w "%{http_code}\n" http://127.0.0.1:8031/v1/completions \
            -H 'content-type: application/json' \
            -d '{"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": true}' > "$OUT/stall_status.txt"
        t1=$(date +%s%N)
        echo "completion: HTTP $(cat "$OUT/stall_status.txt") after $(( (t1 - t0) / 1000000 )) ms" | tee "$OUT/stall_summary.txt"
        cat "$OUT/stall_completion.json"; echo
        echo "health: HTTP $(curl -s -o "$OUT/stall_health.json" -w '%{http_code}' http://127.0.0.1:8031/health)" | tee -a "$OUT/stall_summary.txt"
        cat "$OUT/stall_health.json"; echo
        t0=$(date +%s%N)
        echo "a later request: HTTP $(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8031/v1/completions \
            -H 'content-type: application/json' -d '{"prompt": "Hi", "max_tokens": 4}') after $(( ($(date +%s%N) - t0) / 1000000 )) ms" |
            tee -a "$OUT/stall_summary.txt"
    else
        echo "server did not come up"; tail -20 "$OUT/stall_serve.log"
    fi
    kill $pid 2>/dev/null
    for _ in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
    kill -9 $pid 2>/dev/null
    wait $pid
    echo "server exit status after SIGTERM: $? (137: killed after 30 s)" | tee -a "$OUT/stall_summary.txt"
    grep -E "ERROR|WARN|TP 2|stopped|SIGTERM" "$OUT/stall_serve.log" | cut -c1-300 | head -12
    ;;
fast | slow)
    [ "$PHASE" = slow ] && export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
    echo "== $PHASE link: topo --measure and the plan for the 8B"
    $S topo --measure --save "$OUT/topology_$PHASE.json" > "$OUT/topo_$PHASE.txt" 2>&1
    grep -E "all-reduce|GPU0|GPU1" "$OUT/topo_$PHASE.txt" | head -8
    $S plan --model "$L8" --topology "$OUT/topology_$PHASE.json" > "$OUT/plan_$PHASE.txt" 2>&1
    grep -iE "chosen|choice|->|TP|PP" "$OUT/plan_$PHASE.txt" | head -6
    # On NVLink the plan is TP 2 (run as forced TP 2); over sockets it is run as --plan beside forced
    # TP 2. One GPU uses no NCCL, so it runs once, with the fast link.
    if [ -n "${LAYOUTS:-}" ]; then
        read -r -a names <<< "$LAYOUTS"; layouts=()
        for n in "${names[@]}"; do
            case $n in tp2) layouts+=("tp2:--tensor-parallel-size 2");; pp2) layouts+=("pp2:--pipeline-parallel-size 2");;
                       one) layouts+=("one:--gpu 0");; plan) layouts+=("plan:--plan");; esac
        done
    elif [ "$PHASE" = fast ]; then
        layouts=("tp2:--tensor-parallel-size 2" "pp2:--pipeline-parallel-size 2" "one:--gpu 0")
    else
        layouts=("plan:--plan" "tp2:--tensor-parallel-size 2")
    fi
    for l in "${layouts[@]}"; do
        name=${l%%:*}
        echo "== bench-gpu $name ($PHASE link)"
        # shellcheck disable=SC2086
        timeout 170 $S bench-gpu --model "$L8" ${l#*:} --levels 1,16,20,64 --prompt-tokens 512 --output-tokens 1024 \
            --decode-tokens 128 --kv-cache-dtypes auto --out "$OUT/bench_${PHASE}_$name.json" > "$OUT/bench_${PHASE}_$name.log" 2>&1
        echo "exit $?"
        grep -E "^model|single stream|^\| auto|GPU error|Error|error" "$OUT/bench_${PHASE}_$name.log" | cut -c1-400 | head -8
    done
    ;;
seeds)
    Q32=$CK/qwen2.5-32b
    make_ckpt qwen2.5-32b "$Q32" qwen2.5
    echo "== serve the 32B under the auto plan"
    $S serve --model "$Q32" --device cuda --port 8032 --max-model-len 4096 > "$OUT/seeds_serve.log" 2>&1 &
    pid=$!
    if wait_up 8032; then
        grep -iE "chosen|TP .* x PP|KV blocks" "$OUT/seeds_serve.log" | cut -c1-300 | head -6
        echo "== 20 users arriving together (closed loop, 40 requests)"
        timeout 200 $S bench --base-url http://127.0.0.1:8032 --endpoint completions --concurrency 20 --num-requests 40 \
            --input-len 512 --output-len 1024 --ignore-eos --output "$OUT/seeds_bench.json" > "$OUT/seeds_bench.txt" 2>&1
        echo "exit $?"
        tail -30 "$OUT/seeds_bench.txt"
        # Requests last ~1024 steps (~12 s): 1.5 arrivals a second keep up to ~20 in flight (capped at 20).
        echo "== 20 users arriving as a Poisson stream (${SEEDS_RATE:-1.5} req/s, at most 20 in flight)"
        timeout 240 $S bench --base-url http://127.0.0.1:8032 --endpoint completions --concurrency 20 \
            --request-rate "${SEEDS_RATE:-1.5}" --num-requests "${SEEDS_REQUESTS:-150}" --input-len 512 --output-len 1024 \
            --ignore-eos --output "$OUT/seeds_poisson.json" > "$OUT/seeds_poisson.txt" 2>&1
        echo "exit $?"
        tail -30 "$OUT/seeds_poisson.txt"
    else
        echo "server did not come up"; tail -30 "$OUT/seeds_serve.log"
    fi
    kill $pid 2>/dev/null; sleep 3; kill -9 $pid 2>/dev/null
    ;;
esac
