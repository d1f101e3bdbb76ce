#!/usr/bin/env bash
# The simulator against real pp=2 runs (issue 25): each run below trains 25 iterations with
# --load_trace, then `fulcrum_sim --trace` replays that trace and compares its predicted
# pipeline time and bubble ratio with what the run measured (mean over iterations 2..N; the
# first includes start-up). Every schedule, a balancer on and off, and plugins. Transfers
# are not modelled (fulcrum_sim's default --p2p_bytes for a trace: 0): between two
# processes on one host the hand-over of an activation is part of the producing action's
# measured time (NOTE [simulated hand-over] in dynamic/trace_replay.h).
#
#   tools/validate_sim.sh [BUILD_DIR=build] [WORK_DIR=a new temporary directory]
#
# Prints one Markdown row per run. Takes ~6 minutes on the 2-core machine; quiet cores
# matter (the runs are timed).
set -euo pipefail
build=${1:-build}
work=${2:-$(mktemp -d)}
mkdir -p "$work"
bin=$(cd "$build/bin" && pwd)
iters=${VALIDATE_SIM_ITERS:-25}

echo "| run (pp=2, $iters iterations) | schedule | balancer | placements reproduced | pipeline ms, predicted / measured | bubble ratio, predicted / measured |"
echo "| --- | --- | --- | --- | --- | --- |"
run() {  # name, description, schedule label, flags...
  local name=$1 what=$2 label=$3
  shift 3
  rm -f "$work/$name.trace" "$work/$name.jsonl"
  if ! "$bin/fulcrum_launch" --nproc_per_node=2 -- "$bin/fulcrum_train" \
      --pipeline_model_parallel_size=2 --train_iters="$iters" --load_trace="$work/$name.trace" \
      --metrics_file="$work/$name.jsonl" "$@" >"$work/$name.log" 2>&1; then
    echo "validate_sim: the run '$name' failed; see $work/$name.log" >&2
    exit 1
  fi
  if ! "$bin/fulcrum_sim" --trace="$work/$name.trace" >"$work/$name.sim" 2>&1; then
    echo "validate_sim: fulcrum_sim failed on the trace of '$name'; see $work/$name.sim" >&2
    exit 1
  fi
  local balancer agree mean
  balancer=$(grep -o "live rebalancer '[a-z]*'" "$work/$name.sim" | sed "s/.*'\(.*\)'/\1/" || true)
  agree=$(grep -o "agree in [0-9]* of [0-9]*" "$work/$name.sim" | sed 's/agree in //' || true)
  mean=$(grep "mean over iterations" "$work/$name.sim" || true)
  if [ -z "$mean" ]; then
    echo "validate_sim: no validation of '$name' in $work/$name.sim (no strategy like the live one?)" >&2
    exit 1
  fi
  # "pipeline P predicted / M measured ms (+x%); bubble p / m (+y%)"
  echo "$mean" | sed -E "s#.*pipeline ([0-9.]+) predicted / ([0-9.]+) measured ms \(([-+0-9.]+%)\); bubble ([0-9.]+) / ([0-9.]+) \(([-+0-9.]+%)\)#| $what | $label | $balancer | $agree | \1 / \2 (\3) | \4 / \5 (\6) |#"
}
tiny="--recipe=tiny --global_batch_size=64"
run 1f1b "tiny (4 layers), 8 micro-batches" 1F1B $tiny --pipeline_schedule=1f1b
run zbh1 "tiny, 8 micro-batches" ZB-H1 $tiny --pipeline_schedule=zbh1
run zbh2 "tiny, 8 micro-batches" ZB-H2 $tiny --pipeline_schedule=zbh2
run interleaved "tiny, 8 micro-batches, 2 chunks per rank" "interleaved 1F1B" $tiny \
  --pipeline_schedule=1f1b --virtual_pipeline_model_parallel_size=2
run zbv "tiny, 8 micro-batches, a V" ZB-V $tiny --pipeline_schedule=zbv
moe="--recipe=tiny_moe --num_layers=8 --global_batch_size=64"
run moe_zbh1 "tiny_moe, 8 layers, MoE layers 0–3, 8 micro-batches" ZB-H1 $moe \
  --moe_layer_freq=[1,1,1,1,0,0,0,0] --pipeline_schedule=zbh1 --rebalancer=partition
run moe_zbv "tiny_moe, 8 layers, MoE layers 0, 1, 6, 7, a V" ZB-V $moe \
  --moe_layer_freq=[1,1,0,0,0,0,1,1] --pipeline_schedule=zbv --rebalancer=partition
run freeze "tiny, 8 layers, freeze layers 0–3 at iteration 5" ZB-H1 $tiny --num_layers=8 \
  --plugins=freeze --freeze_schedule=5:0-3 --pipeline_schedule=zbh1 --rebalancer=diffusion
run prune "tiny, prune from iteration 5 to 80%" 1F1B $tiny --plugins=prune \
  --prune_start_iter=5 --prune_end_iter=15 --prune_final_sparsity=0.8 --pipeline_schedule=1f1b \
  --rebalancer=partition
