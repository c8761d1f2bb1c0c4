#!/usr/bin/env bash
# Issue 30 point 6, one H200 as the seeds' 24 GiB card: a Qwen2.5-32B-shaped Q4_K_M with random
# weights, written directly by `strata quantize --random-weights` (its template GGUF: the random
# Qwen2.5-7B's tokenizer, written by llama.cpp's convert_hf_to_gguf.py --vocab-only), served by
# `strata serve --gpu-memory-limit 24GiB` and by llama.cpp's `llama-server -np 20` with its context
# sized to strata's KV tokens, each under `strata bench`: 20 users, 512-token prompts, 1024-token
# answers, first all arriving together, then 20 more with Poisson arrivals at 80 % of the request
# rate strata sustained in the first run. TTFT p50/p95, TPOT, output tok/s and errors in
# $OUT/results_seeds.tgz, packed again after every step.
# PREP=1 only makes the file (7 minutes on the GPU machine's 16 cores): start it in an earlier call of the same
# machine, beside fp8.sh (which makes the 7B checkpoint it reads; it waits for that), as
# `PREP=1 setsid bash scripts/gpu/seeds_32b.sh > LOG 2>&1 < /dev/null &` after the binaries
# are unpacked, and the run waits for it. RERUNS="VAR=VALUE ..." adds strata's
# closed run under each setting (see the end). Carries
# gpu-bin/strata.gz, tokenizers-qwen2.5.tgz and llama-src.tar.xz (the convert script) for the file, and
# gpu-bin/llama-bin.tar.xz.part* (llama.cpp's CUDA binaries, from `make gpu-bin-llama`) for the run.
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
LL=/root/llama.cpp
GG=/root/gguf
Q32=$CK/qwen2.5-32b-config
M32=$GG/qwen32b-random-q4_k_m.gguf
LIMIT=${LIMIT:-24GiB}
# KV_DTYPE=fp8: strata's cache in E4M3 and llama.cpp's in q8_0 (about the same bytes a token).
STRATA_KV=(--kv-cache-dtype "${KV_DTYPE:-auto}")
LLAMA_KV=()
[ "${KV_DTYPE:-auto}" = fp8 ] && LLAMA_KV=(-ctk q8_0 -ctv q8_0)
mkdir -p $LL $GG
# make_file: the 32B file, from the 7B checkpoint's tokenizer; $GG/prep.done holds its exit line.
make_file() {
    qwen_vocab_gguf $GG/qwen7b-vocab.gguf $LL
    python3 scripts/gpu/hf_reference.py qwen2.5-32b $Q32 gpu-bin/tokenizers/qwen2.5 --config-only
    /usr/bin/time -f "quantize: %e s, %M KiB" timeout 900 $S quantize $GG/qwen7b-vocab.gguf $M32 --type Q4_K_M \
        --random-weights $Q32/config.json --threads ${THREADS:-16} > $GG/quantize_32b.log 2>&1
    echo "file exit $?" > $GG/prep.done
}
if [ -n "${PREP:-}" ]; then
    echo $$ > $GG/prep.pid
    # Started beside fp8.sh: let it make the 7B checkpoint (up to 5 minutes).
    for _ in $(seq 60); do
        [ -f $Q7/config.json ] && ! pgrep -f hf_reference.py >/dev/null && break
        sleep 5
    done
    [ -f $M32 ] || make_file
    exit 0
fi
start_results seeds
[ -x $LL/build/bin/llama-server ] || cat gpu-bin/llama-bin.tar.xz.part* | tar xJf - -C $LL
if [ ! -f $M32 ]; then
    if [ -f $GG/prep.pid ] && kill -0 "$(cat $GG/prep.pid)" 2>/dev/null; then
        echo "waiting for the file from an earlier call"
        while kill -0 "$(cat $GG/prep.pid)" 2>/dev/null; do sleep 5; done
    fi
    [ -f $M32 ] || make_file
fi
cat $GG/prep.done 2>/dev/null
cp $GG/*.log "$OUT/" 2>/dev/null
tail -3 $GG/quantize_32b.log
ls -la $M32

# strata bench against PORT: the closed run (20 at once) or the Poisson run at RATE.
bench() {
    local port=$1 name=$2 rate=${3:-}
    local load=(--concurrency 20 --num-requests 20)
    [ -n "$rate" ] && load=(--concurrency 20 --num-requests 20 --request-rate "$rate")
    timeout 400 $S bench --base-url http://127.0.0.1:$port --endpoint completions "${load[@]}" --warmup 2 \
        --input-len 512 --output-len 1024 --ignore-eos --output "$OUT/bench_$name.json" > "$OUT/bench_$name.txt" 2>&1
    echo "-- $name, exit $?"
    grep -E "TTFT|TPOT|output tok|throughput|error" "$OUT/bench_$name.txt" | head -8
    pack
}

# LLAMA_FIT_ONLY=1: only llama.cpp with the slots that fit (below), on KV_TOKENS (strata's KV
# tokens from an earlier call, default 11760) and RATE (that call's Poisson rate): the whole
# script takes more than one call's ten minutes; LLAMA_POISSON_ONLY=1 then skips its closed run.
if [ -n "${LLAMA_FIT_ONLY:-}" ]; then
    kv=${KV_TOKENS:-11760}
    rate=${RATE:-}
else
    # Both servers stay loaded side by side (strata sized as a 24 GiB card, llama.cpp beside it on the
    # rest), each measured while the other idles: the closed runs first, then the Poisson runs.
    echo "== strata serve, --gpu-memory-limit $LIMIT"
    $S serve --model $M32 --port 8050 --gpu-memory-limit $LIMIT --max-model-len 2048 --max-num-seqs 20 "${STRATA_KV[@]}" \
        > "$OUT/strata_serve.log" 2>&1 &
    pid=$!
    up=
    # A 19 GiB file took strata ~3.5 minutes to load on one core (bench/NOTES.md): up to 8 here.
    wait_up 8050 480 && up=1 && grep -iE "weights|KV cache|sequences of" "$OUT/strata_serve.log" | cut -c1-300 | head -4
    # A strata still loading would count llama.cpp's allocations as its own: stop it first.
    [ -n "$up" ] || { echo "strata did not come up"; tail -20 "$OUT/strata_serve.log"; kill $pid; wait $pid; }
    # strata's KV tokens, for llama.cpp's context: the same KV budget, one pool all slots share (-kvu;
    # without it each of the 20 slots gets a twentieth, too little for one request).
    kv=$(grep -oE "= [0-9]+ tokens" "$OUT/strata_serve.log" | head -1 | grep -oE "[0-9]+")
    echo "== llama-server -np 20 -kvu -c ${kv:-30720} ${LLAMA_KV[*]}"
    $LL/build/bin/llama-server -m $M32 -ngl 99 -np 20 -kvu -c "${kv:-30720}" "${LLAMA_KV[@]}" --port 8051 -fa on \
        > "$OUT/llama_server.log" 2>&1 &
    lpid=$!
    lup=
    wait_up 8051 && lup=1
    [ -n "$lup" ] || { echo "llama-server did not come up"; tail -20 "$OUT/llama_server.log"; }
    [ -n "$up" ] && bench 8050 strata_closed
    [ -n "$lup" ] && bench 8051 llama_closed
    rate=$(python3 -c "import json; r=json.load(open('$OUT/bench_strata_closed.json'))['runs'][0]; print(round(0.8*r['request_throughput'], 4))" 2>/dev/null)
    echo "Poisson rate: ${rate:-none} requests/s"
    [ -n "$up" ] && [ -n "$rate" ] && bench 8050 strata_poisson "$rate"
    [ -n "$lup" ] && [ -n "$rate" ] && bench 8051 llama_poisson "$rate"
    kill $pid $lpid 2>/dev/null; wait $pid $lpid 2>/dev/null
    pack
fi
# llama.cpp fails a request whose slot cannot grow in a full pool ("Context size has been
# exceeded") rather than queueing it: also run it with the slots that fit the budget whole.
fit=$(( ${kv:-30720} / (512 + 1024) ))
if [ "$fit" -ge 1 ] && [ "$fit" -lt 20 ]; then
    echo "== llama-server -np $fit -kvu -c ${kv:-30720} ${LLAMA_KV[*]} (the slots that fit)"
    $LL/build/bin/llama-server -m $M32 -ngl 99 -np $fit -kvu -c "${kv:-30720}" "${LLAMA_KV[@]}" --port 8061 -fa on \
        > "$OUT/llama_server_np$fit.log" 2>&1 &
    lpid=$!
    if wait_up 8061; then
        # LLAMA_POISSON_ONLY=1: the closed run is already on record (NOTES: the third try).
        [ -z "${LLAMA_POISSON_ONLY:-}" ] && bench 8061 llama_np${fit}_closed
        [ -n "$rate" ] && bench 8061 llama_np${fit}_poisson "$rate"
    fi
    kill $lpid 2>/dev/null; wait $lpid 2>/dev/null
fi
# RERUNS="VAR=VALUE ...": strata's closed run again under each setting, e.g.
# STRATA_QUANT_GEMM_MAX_TOKENS=0 (dequantizing for cuBLASLt instead of the tensor-core GEMM,
# NOTES v25) or STRATA_QUANT_GEMV_MAX_TOKENS=32 (GEMV passes, NOTES v24).
port=8052
for setting in ${RERUNS:-}; do
    echo "== strata serve, $setting"
    env "$setting" $S serve --model $M32 --port $port --gpu-memory-limit $LIMIT \
        --max-model-len 2048 --max-num-seqs 20 "${STRATA_KV[@]}" > "$OUT/strata_serve_${setting%%=*}.log" 2>&1 &
    pid=$!
    wait_up $port 480 && bench $port "strata_closed_${setting//=/_}"
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
    port=$((port + 1))
done
