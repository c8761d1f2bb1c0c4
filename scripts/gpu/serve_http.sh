#!/usr/bin/env bash
# One H200: `strata serve` on the random-weight Llama-3-8B (the GPU found and used by itself, greedy
# decode steps overlapped) under `strata bench` through HTTP with streaming, closed loops of 32 users
# (512-token prompts, 128-token answers) and 256 users (512 / 256): TTFT percentiles, throughput and
# errors, JSON and text in $OUT. Carries gpu-bin/strata.gz and gpu-bin/tokenizers.tgz.
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
llama3_8b_checkpoint
$S serve --model "$L8" --port 8040 --max-model-len 4096 > "$OUT/http_serve.log" 2>&1 &
pid=$!
if wait_up 8040; then
    grep -iE "engine on|KV cache|sequences of" "$OUT/http_serve.log" | cut -c1-300 | head -4
    for run in 32:96:128 256:256:256; do
        IFS=: read -r users requests answer <<< "$run"
        echo "== $users users, $requests requests, 512-token prompts, $answer-token answers (streamed completions)"
        timeout 200 $S bench --base-url http://127.0.0.1:8040 --endpoint completions --concurrency "$users" \
            --num-requests "$requests" --warmup 8 --input-len 512 --output-len "$answer" --ignore-eos \
            --output "$OUT/http_bench_$users.json" > "$OUT/http_bench_$users.txt" 2>&1
        echo "exit $?"
        tail -25 "$OUT/http_bench_$users.txt"
    done
    grep -E "ERROR|WARN|panick" "$OUT/http_serve.log" | cut -c1-300 | head -5
else
    echo "server did not come up"
    tail -30 "$OUT/http_serve.log"
fi
kill $pid 2>/dev/null
wait $pid
echo "server exit status after SIGTERM: $?"
