#!/usr/bin/env bash
# Call 2 (after ../2026-11-26c/stage.sh): where the one-GPU step's time goes now, for issue
# 23's MFU goal — a Kineto profile of 3 Fulcrum steps of the benchmark model (bf16), summed
# per kernel and per host op (tools/op_profile_summary.py), on the binaries of 7a66555.
set -uo pipefail
source docs/gpu-runs/device_env.sh
timeout 300 build/bin/fulcrum_bench_train --device=cuda --bf16 --quick --profile_trace="$out/prof" \
  > "$out/bench_train.txt" 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^  fulcrum " "$out/bench_train.txt"
trace=$(ls "$out"/prof.*.json | head -1)
python3 tools/op_profile_summary.py "$trace" --kernels --top=40 > "$out/kernels_fulcrum.txt" 2>&1
python3 tools/op_profile_summary.py "$trace" --top=40 > "$out/ops_fulcrum.txt" 2>&1
rm -f "$out"/prof.*.json
head -60 "$out/kernels_fulcrum.txt"
echo "done after $((SECONDS - t0)) s"
