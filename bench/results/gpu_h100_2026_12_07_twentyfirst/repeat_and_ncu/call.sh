# The second call (same machine, warm): tail1 and the default again, then ncu of qgemm_wide_q6_k.
set -u
source scripts/gpu/libs.sh
start_results call4
pack_every 15
F=$Q4KM
for r in tail1 default; do
  if [ $r = tail1 ]; then E=STRATA_QUANT_WIDE_TAIL=1; else E=X=1; fi
  echo "-- $r (t=$SECONDS)"
  env $E timeout 100 $S bench-gpu --model $F --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 128 --out $OUT/bench_${r}_2.json > $OUT/bench_${r}_2.log 2>&1
  grep -E "^\| bf16 " $OUT/bench_${r}_2.log | cut -c1-200
done
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu=$NCU (t=$SECONDS)"
STRATA_QUANT_WIDE_TAIL=1 STRATA_QUANT_GEMM_MAX_TOKENS=512 timeout 200 $NCU --clock-control none -k "regex:qgemm_wide_q6_k" -s 300 -c 2 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' --import-source no -o /tmp/ncu_q6 -f $S bench-gpu --model $F --enforce-eager --gpu-memory-limit 24GiB --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 64 --decode-tokens 32 --out /tmp/ncu.json > $OUT/ncu_run.log 2>&1
$NCU --import /tmp/ncu_q6.ncu-rep --print-summary none > $OUT/ncu_q6.log 2>&1
$NCU --import /tmp/ncu_q6.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $OUT/ncu_q6_sass.csv.gz
grep -E "Grid Size|Duration|Issue Slots Busy|issue_stalled" $OUT/ncu_q6.log | head -50
echo "end t=$SECONDS"
packer_stop
