#!/usr/bin/env bash
# Issue 7 on the GPU machine: `strata topo` (plain, --measure, --json) and `strata plan` for an 8B and a
# 70B-class model, with NCCL's fast paths and again with P2P and SHM off. Writes everything to $OUT/.
# Needs target/release/strata built with `--features cuda`; no Rust toolchain, no network.
set -u
: "${OUT:?set OUT to the folder for the outputs}"
STRATA=${STRATA:-target/release/strata}
mkdir -p "$OUT"

# Never NVLink multicast (see DESIGN.md); the plan says the same.
export NCCL_NVLS_ENABLE=0

shim="$OUT/.libshim"
source "$(dirname "$0")/libs.sh"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" > "$OUT/environment.txt"
nvidia-smi topo -m > "$OUT/nvidia_smi_topo.txt" 2>&1 || true
nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1 || true

# run NAME CMD...: stdout to $OUT/NAME.txt (or .json), stderr to $OUT/NAME.stderr, exit code noted.
status=0
run() {
    local name=$1; shift
    "$@" > "$OUT/$name" 2> "$OUT/$name.stderr"
    local rc=$?
    echo "$rc  $name  $*" >> "$OUT/exit_codes.txt"
    [ "$rc" -eq 0 ] || status=1
}

run topo.txt "$STRATA" topo
run topo.json "$STRATA" topo --json
run topo_measure.txt "$STRATA" topo --measure --save "$OUT/topology_measured.json"
for model in llama-3-8b llama-3-70b; do
    run "plan_${model}.txt" "$STRATA" plan --model "$model"
    run "plan_${model}.json" "$STRATA" plan --model "$model" --json
    run "plan_${model}_measured.txt" "$STRATA" plan --model "$model" --topology "$OUT/topology_measured.json"
    run "plan_${model}_tp1.txt" "$STRATA" plan --model "$model" --tensor-parallel-size 1
done

# The slow-link variant: NCCL without P2P and shared memory (what a box without P2P gets).
(
    export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
    run topo_measure_slow.txt "$STRATA" topo --measure --save "$OUT/topology_measured_slow.json"
    for model in llama-3-8b llama-3-70b; do
        run "plan_${model}_measured_slow.txt" "$STRATA" plan --model "$model" --topology "$OUT/topology_measured_slow.json"
    done
    exit $status
) || status=1

rm -rf "$shim"
cat "$OUT/exit_codes.txt"
exit $status
