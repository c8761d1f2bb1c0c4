#!/usr/bin/env bash
# The H200's SM clock, memory clock and power every 100 ms while the attention kernels run alone
# (strata bench-gpu --attention) and while the engine serves 256 users (bench-gpu --levels 256):
# tells whether attention is slower inside a step because the GPU clocks down under the GEMMs.
# Outputs in $OUT: clocks.csv (nvidia-smi samples), phases.txt (when each phase began), the logs.
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
llama3_8b_checkpoint
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 100 > "$OUT/clocks.csv" &
smi=$!
phase() { echo "$(date +%Y/%m/%d\ %H:%M:%S.%3N) $1" >> "$OUT/phases.txt"; }
phase "idle"; sleep 2
phase "attention alone"
timeout 120 $S bench-gpu --attention --levels 240 --prompt-tokens 512 --output-tokens 256 \
    --out "$OUT/attention_alone.json" > "$OUT/attention_alone.log" 2>&1
phase "engine, 256 users"
timeout 200 $S bench-gpu --model $L8 --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 256 \
    --out "$OUT/bench_256.json" > "$OUT/bench_256.log" 2>&1
phase "done"
kill $smi
grep -v "^\[" "$OUT/attention_alone.log" | head -6
grep "x256" "$OUT/bench_256.log"
# Median SM clock and power of each phase.
python3 - "$OUT" <<'PY'
import sys, datetime, statistics
out = sys.argv[1]
parse = lambda s: datetime.datetime.strptime(s.strip()[:23], "%Y/%m/%d %H:%M:%S.%f")
phases = [(parse(l[:23]), l[24:].strip()) for l in open(f"{out}/phases.txt")]
rows = []
for l in open(f"{out}/clocks.csv"):
    f = [x.strip() for x in l.split(",")]
    try:
        rows.append((parse(f[0]), float(f[1].split()[0]), float(f[2].split()[0]), float(f[3].split()[0])))
    except (ValueError, IndexError):
        pass
# A phase's loading and idle samples would set its medians, so the samples under load are
# also counted apart by power: the cap (700 W) lowers the SM clock in the top band.
def summary(sel):
    return (f"{len(sel)} samples, SM clock median {statistics.median(r[1] for r in sel):.0f} MHz "
            f"(min {min(r[1] for r in sel):.0f}), memory {statistics.median(r[2] for r in sel):.0f} MHz, "
            f"power median {statistics.median(r[3] for r in sel):.0f} W (max {max(r[3] for r in sel):.0f})")
for (t0, name), (t1, _) in zip(phases, phases[1:]):
    sel = [r for r in rows if t0 <= r[0] < t1]
    if sel:
        print(f"{name}: {summary(sel)}")
    for label, lo, hi in [("400-600 W", 400, 600), ("600 W and more", 600, float("inf"))]:
        band = [r for r in sel if lo <= r[3] < hi]
        if band:
            print(f"  at {label}: {summary(band)}")
PY
