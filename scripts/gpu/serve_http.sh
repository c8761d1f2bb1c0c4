#!/usr/bin/env bash
# One H200: `strata serve` on the random-weight Llama-3-8B (the GPU found and used by itself, decode
# steps overlapped) under `strata bench` through HTTP with streaming, closed loops of 32 users
# (512-token prompts, 128-token answers) and 256 users (512 / 256) at the API's default sampling
# (temperature 1), then 256 users with temperature 0.7 and top_p 0.9, and greedy: TTFT percentiles,
# throughput and errors, JSON and text in $OUT. Each run is warmed up with as many requests as it
# has users and has prompts of its own seed (the same prompts would be found in the prefix cache).
# Carries gpu-bin/strata.gz and gpu-bin/tokenizers-llama3.tgz.
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
llama3_8b_checkpoint
$S serve --model "$L8" --port 8040 --max-model-len 4096 > "$OUT/http_serve.log" 2>&1 &
pid=$!
if wait_up 8040; then
    grep -iE "engine on|KV cache|sequences of" "$OUT/http_serve.log" | cut -c1-300 | head -4
    seed=0
    for run in 32:96:128:default 256:256:256:default 256:256:256:top_p 256:256:256:greedy; do
        IFS=: read -r users requests answer sampling <<< "$run"
        seed=$((seed + 1))
        case $sampling in
            default) flags=() ;;
            top_p) flags=(--temperature 0.7 --top-p 0.9) ;;
            greedy) flags=(--temperature 0) ;;
        esac
        name="${users}_$sampling"
        echo "== $users users, $requests requests, 512-token prompts, $answer-token answers (streamed completions), sampling: $sampling ${flags[*]}"
        timeout 200 $S bench --base-url http://127.0.0.1:8040 --endpoint completions --concurrency "$users" \
            --num-requests "$requests" --warmup "$users" --seed "$seed" --input-len 512 --output-len "$answer" --ignore-eos "${flags[@]}" \
            --output "$OUT/http_bench_$name.json" > "$OUT/http_bench_$name.txt" 2>&1
        echo "exit $?"
        tail -25 "$OUT/http_bench_$name.txt"
    done
    grep -E "ERROR|WARN|panick" "$OUT/http_serve.log" | cut -c1-300 | head -5
else
    echo "server did not come up"
    tail -30 "$OUT/http_serve.log"
fi
kill $pid 2>/dev/null
wait $pid
echo "server exit status after SIGTERM: $?"
