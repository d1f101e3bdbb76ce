#!/usr/bin/env bash
# Regenerates the measured profiles fulcrum_sim's named cases replay (issue 25 item 2): each
# is the --metrics_file of a fulcrum_train run with one of our dynamism plugins, cut down to
# the iteration number and the fields the simulator reads (tools/internal/sim_cases.h says
# which). They are compiled into fulcrum_sim (tools/CMakeLists.txt embeds every
# tools/profiles/*.jsonl), so `fulcrum_sim --case=all` needs no input files; the same files,
# or another run's full metrics file, can be given by hand (--moe_metrics, --prune_metrics,
# --early_exit_metrics, --sparse_attention_metrics).
#
#   tools/profiles/make_profiles.sh [build-dir] [profile ...]   (default: build, all four)
#
# One process, two threads, on the 2-core development machine; each run's command is written
# beside its numbers in the file's first line ("source"), so the file says what made it.
# About 20 minutes for all four on a quiet machine (prune ~10, moe 3, early_exit 1,
# sparse_attention ~6).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="$ROOT/build"
if [ $# -gt 0 ] && [ -d "$1" ]; then  # a build directory first, else only profile names
  BUILD="$1"
  shift
fi
PROFILES=("$@")
[ ${#PROFILES[@]} -gt 0 ] || PROFILES=(moe prune early_exit sparse_attention)
TRAIN="$BUILD/bin/fulcrum_train"
[ -x "$TRAIN" ] || { echo "make_profiles: no $TRAIN (build first)" >&2; exit 1; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# profile NAME FIELDS -- fulcrum_train flags...: runs it, keeps FIELDS (comma-separated) of
# the records that hold the first of them.
profile() {
  local name="$1" fields="$2"
  shift 3
  echo "make_profiles: $name: fulcrum_train $*" >&2
  OMP_NUM_THREADS=2 "$TRAIN" "$@" --metrics_file="$WORK/$name.jsonl" --log_interval=100 \
      --eval_interval=0 > "$WORK/$name.log" 2>&1 || { tail -20 "$WORK/$name.log" >&2; exit 1; }
  python3 - "$WORK/$name.jsonl" "$ROOT/tools/profiles/$name.jsonl" "$fields" "fulcrum_train $*" <<'EOF'
import json, os, sys
src, dst, fields, command = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
lines = [json.dumps({"source": command}, separators=(",", ":"))]
for text in open(src):
    record = json.loads(text)
    kept = {k: record[k] for k in fields if k in record}
    if fields[0] in record and "iteration" in record:
        lines.append(json.dumps({"iteration": record["iteration"], **kept}, separators=(",", ":")))
tmp = dst + ".tmp"
with open(tmp, "w") as out:
    out.write("\n".join(lines) + "\n")
os.replace(tmp, dst)
print(f"make_profiles: wrote {dst} ({len(lines) - 1} records)", file=sys.stderr)
EOF
}

for name in "${PROFILES[@]}"; do
  case "$name" in
    # MoE: every layer MoE, 8 layers, dropless top-2 over 8 experts; 300 iterations, so the
    # loads' persistence from one iteration to the next can be measured.
    moe) profile moe expert_tokens -- --recipe=tiny_moe --num_layers=8 --moe_layer_freq=1 \
             --moe_capacity_factor=0 --train_iters=300 ;;
    # Pruning: DynMo's schedule scaled by 1/10 (0 -> 52 -> 79 -> 89 -> 90% at iterations
    # 300..700 of 1000, global magnitude pruning) on an 8-layer model trained 300 iterations
    # first, so that its layers' weights have moved apart before the first step.
    prune) profile prune prune_target_sparsity,sparsity,prune_layer_density -- --recipe=tiny \
               --num_layers=8 --train_iters=1000 --plugins=prune --prune_start_iter=300 \
               --prune_end_iter=700 --prune_interval=100 --prune_final_sparsity=0.9 ;;
    # Early exit: an exit head after every layer but the last (CALM), softmax confidence, at
    # a threshold low enough that a CALM-like share of the tokens (30-50%) reaches the last
    # layer once the exit heads have trained: 48% after iteration 50 at 0.25 (0.3: ~65%,
    # 0.2: ~22%, 0.15: ~4% on this model); no token exits in the first ~30 iterations.
    early_exit) profile early_exit early_exit_tokens -- --recipe=tiny --num_layers=8 \
                    --plugins=early_exit --early_exit_threshold=0.25 --train_iters=200 ;;
    # Sparse attention: hash sparse attention (8 buckets, blocks of 64) in every layer of an
    # 8-layer model at DynMo's sequence length, 2048; each layer's score density per
    # iteration.
    sparse_attention) profile sparse_attention sparse_attention_layer_density -- --recipe=tiny \
                          --num_layers=8 --seq_length=2048 --micro_batch_size=1 \
                          --global_batch_size=4 --plugins=sparse_attention \
                          --sparse_attention_buckets=8 --sparse_attention_block=64 \
                          --train_iters=100 ;;
    *) echo "make_profiles: unknown profile '$name' (moe, prune, early_exit, sparse_attention)" >&2
       exit 2 ;;
  esac
done
