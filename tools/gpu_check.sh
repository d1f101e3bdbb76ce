#!/usr/bin/env bash
# tools/gpu_check.sh [--quick] [--build-dir DIR] [--no-build] [--bundle DIR] [--prefix DIR] OUTDIR
#
# Proves Fulcrum's GPU path on a machine with a GPU, a CUDA toolkit and a python3 with a
# CUDA torch 2.x, without a network: unpacks the bundle of tools/gpu_bundle.sh (dpkg -x)
# into a prefix, builds Fulcrum against python3's torch with FULCRUM_CUDA=ON, runs the GPU
# tests (named *Gpu* or Cuda*, tests/CMakeLists.txt), the training benchmark, and one short
# real training run per feature on --device=cuda, and writes ONE report: OUTDIR/report.md and OUTDIR/report.json,
# each check "pass", "fail" or "not run (why)" with its figures, seconds and command; the
# logs are in OUTDIR/logs/. Exit status: 0 when no check failed.
#
# On a machine without a GPU it still runs end to end: the GPU checks read
# "not run (no GPU visible)". The two-rank checks (pp, tp, dp, ep, a migration, ZB-V with
# moves) run one rank per GPU over NCCL when two GPUs are visible; with one GPU both ranks
# share it over Gloo with host staging (NCCL refuses two ranks on one GPU; NOTE [host
# staging] in parallel/host_staged_communicator.h), and the report says which. Each
# multi-rank run's losses are compared with the one-process run of the same recipe.
#
#   --quick       the fewest build targets, 3 iterations per run, a short benchmark: fits
#                 the device machine's 10-minute command with a build on 16 cores.
#   --build-dir   where to build (default build-gpu); an existing one is reused
#                 (incremental), so a second call does not pay the build again.
#   --no-build    use the binaries already in --build-dir (the CPU ctest does this).
#   --bundle DIR  the .deb folder of tools/gpu_bundle.sh, unpacked into --prefix.
#   --prefix DIR  where the bundle goes (default /tmp/fulcrum-prefix).
#   --check-timeout S  kills a check (its whole process group) after S seconds and records
#                 it as failed, so one hung run (an NCCL wait, say) cannot eat the
#                 device machine's time (default 300; the build is not limited).
#   --no-bench    leaves the training benchmark out (recorded as not run).
# $PYTHON names the python3 whose torch is built against (default python3).
set -uo pipefail

quick=0
build_dir=build-gpu
do_build=1
bundle=""
prefix=/tmp/fulcrum-prefix
check_timeout=300
bench=1
out=""
while (( $# )); do
  case "$1" in
    --quick) quick=1 ;;
    --no-build) do_build=0 ;;
    --build-dir) build_dir=$2; shift ;;
    --bundle) bundle=$2; shift ;;
    --prefix) prefix=$2; shift ;;
    --check-timeout) check_timeout=$2; shift ;;
    --no-bench) bench=0 ;;
    -h|--help) sed -n 2,30p "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option '$1'" >&2; exit 2 ;;
    *) [[ -z "$out" ]] || { echo "gpu_check.sh: one OUTDIR only (got '$out' and '$1')" >&2; exit 2; }
       out=$1 ;;
  esac
  shift
done
[[ -n "$out" ]] || { echo "usage: tools/gpu_check.sh [--quick] [--build-dir DIR] [--no-build] [--bundle DIR] OUTDIR" >&2; exit 2; }
source_dir=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out/logs" || exit 2
out=$(cd "$out" && pwd)
build_dir=$(mkdir -p "$build_dir" && cd "$build_dir" && pwd)
results="$out/logs/results.tsv"
: >"$results"
bin="$build_dir/bin"
iters=$(( quick ? 3 : 10 ))

# record NAME STATUS SECONDS COMMAND FIGURES
record() {
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$results"
  printf 'gpu_check: %-24s %s %s\n' "$1" "$2" "${5:+($5)}"
}

# run_check NAME FIGURE_FN COMMAND: runs COMMAND (bash -c) with its output in logs/NAME.log,
# killed after --check-timeout seconds (but the build); FIGURE_FN (or "") is given the log
# path and prints the figures to report; its non-zero exit fails the check.
run_check() {
  local name=$1 figures_of=$2 command=$3 log="$out/logs/$1.log" start=$SECONDS status figures=""
  local limit=()
  [[ "$name" != build ]] && limit=(timeout --kill-after=10 "$check_timeout")
  (cd "$out" && "${limit[@]}" bash -c "$command") >"$log" 2>&1
  status=$?
  (( status == 124 || status == 137 )) && [[ "$name" != build ]] &&
    echo "gpu_check: killed after --check-timeout=$check_timeout s" >>"$log"
  if [[ -n "$figures_of" ]]; then
    # A figure function that exits non-zero (a loss off the one-process run, no layer
    # moved) fails the check.
    figures=$($figures_of "$log" 2>/dev/null)
    (( $? != 0 && status == 0 )) && status=1
    figures=$(echo "$figures" | tr '\t\n' '  ')
  fi
  if (( status == 0 )); then
    record "$name" pass $((SECONDS - start)) "$command" "$figures"
  else
    record "$name" fail $((SECONDS - start)) "$command" "exit $status; $(tail -n 3 "$log" | tr '\t\n' '  ' | cut -c1-300) ${figures}"
  fi
}

# --- the machine -----------------------------------------------------------------------
gpus=0
gpu_name="none"
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  (( gpus > 0 )) && gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
fi
torch_prefix=$(${PYTHON:-python3} -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
torch_version=$(${PYTHON:-python3} -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
nvcc_version=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p' || true)
record environment pass 0 "nvidia-smi -L; python3 -c 'import torch'" \
  "GPUs: $gpus ($gpu_name); python3 torch: $torch_version; nvcc: ${nvcc_version:-none}; cores: $(nproc)"
no_gpu="not run (no GPU visible)"

# --- the bundle ------------------------------------------------------------------------
if [[ -n "$bundle" ]]; then
  run_check bundle "" "mkdir -p '$prefix' && for f in '$bundle'/*.deb; do dpkg -x \"\$f\" '$prefix' || exit 1; done"
else
  record bundle "not run (no --bundle given: the build uses the system's packages)" 0 "" ""
fi
prefix_lib="$prefix/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$prefix_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# --- the build -------------------------------------------------------------------------
if (( quick )); then
  # Every test binary that holds a GPU test (names *Gpu*/Cuda*): an unbuilt one lists no tests.
  targets="fulcrum_train fulcrum_launch fulcrum_bench_train parallel_test core_test"
  targets+=" core_kernels_test pipeline_engine_test moe_test"
else
  targets="all"
fi
if (( ! do_build )); then
  record build "not run (--no-build: the binaries in $build_dir)" 0 "" ""
else
  configure=""
  if [[ ! -f "$build_dir/build.ninja" && ! -f "$build_dir/Makefile" ]]; then
    cuda=OFF
    [[ -n "$nvcc_version" ]] && cuda=ON
    configure="cmake -S '$source_dir' -B '$build_dir' -G Ninja -DCMAKE_BUILD_TYPE=Release -DFULCRUM_CUDA=$cuda -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH='$torch_prefix;$prefix/usr' -DCMAKE_LIBRARY_PATH='$prefix_lib' -DCMAKE_INCLUDE_PATH='$prefix/usr/include' && "
  fi
  run_check build "" "${configure}cmake --build '$build_dir' -j$(nproc) --target $targets"
fi

# --- GPU tests -------------------------------------------------------------------------
# ctest's summary: "N% tests passed, F tests failed out of T", or "100% tests passed out of T".
count_tests() {
  sed -n -e 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/failed \1 of \2/p' \
         -e 's/^100% tests passed out of \([0-9]*\).*/failed 0 of \1/p' "$1" | tail -1
}
if (( gpus == 0 )); then
  record gpu_tests "$no_gpu" 0 "ctest -R 'Gpu|Cuda'" ""
else
  # The naming convention (tests/CMakeLists.txt): label gpu, and the Slow* GPU tests.
  run_check gpu_tests count_tests "cd '$build_dir' && ctest -R 'Gpu|Cuda' --output-on-failure --timeout 300"
fi

# --- the benchmark ---------------------------------------------------------------------
bench_figures() { grep -E '^  (fulcrum|plain libtorch|pytorch eager|torch.compile) ' "$1" | tr -s ' ' | tail -8 | paste -sd';'; }
bench_args="--device=cuda --bf16 --compare_reference --reference_python=${PYTHON:-python3}"
(( quick )) && bench_args+=" --quick"
if (( gpus == 0 )); then
  record bench_train "$no_gpu" 0 "$bin/fulcrum_bench_train $bench_args" ""
elif (( ! bench )); then
  record bench_train "not run (--no-bench)" 0 "$bin/fulcrum_bench_train $bench_args" ""
else
  run_check bench_train bench_figures "'$bin/fulcrum_bench_train' $bench_args"
fi

# --- one short training run per feature ------------------------------------------------
# The figures of a run: its iterations, last loss and layers moved; with a reference run's
# log as $2, also the largest |loss difference| over the iterations both logged, and the
# check fails (exit 1) past $loss_tolerance; with $3 = moves it fails if no layer moved,
# with $3 = overlap if no gradient bucket started its reduction before the step.
loss_tolerance=1e-3
loss_of() {
  python3 - "$1" "${2:-}" "$loss_tolerance" "${3:-}" <<'PY'
import json, sys
def rows_of(log):
    rows = []
    for line in open(log.replace(".log", ".jsonl")):
        try: rows.append(json.loads(line))
        except ValueError: pass
    return [r for r in rows if "iteration" in r]
def losses(log):
    return {r["iteration"]: r.get("loss", r.get("lm_loss")) for r in rows_of(log)}
mine = losses(sys.argv[1])
if not mine: sys.exit(0)
last = max(mine)
text = "iterations %d, last loss %s" % (len(mine), mine[last])
moved = max([r.get("layers_moved", 0) for r in rows_of(sys.argv[1])] or [0])
if any("layers_moved" in r for r in rows_of(sys.argv[1])):
    text += "; layers moved %d" % moved
if sys.argv[4] == "moves" and moved == 0:
    print(text + "; no layer moved"); sys.exit(1)
if sys.argv[4] == "async":
    if "(written in the background;" not in open(sys.argv[1], errors="replace").read():
        print(text + "; no save was committed from the background"); sys.exit(1)
    text += "; a save committed from the background"
if sys.argv[4] == "overlap":
    early = sum(r.get("grad_buckets_overlapped", 0) for r in rows_of(sys.argv[1]))
    text += "; gradient buckets started early %d" % early
    if early == 0:
        print(text + "; none overlapped"); sys.exit(1)
if sys.argv[2]:
    ref = losses(sys.argv[2])
    common = [i for i in mine if i in ref and mine[i] is not None and ref[i] is not None]
    if not common:
        print(text + "; no iteration in common with the one-process run"); sys.exit(1)
    diff = max(abs(mine[i] - ref[i]) for i in common)
    text += "; max |loss - one process| %.2e over %d iterations (tolerance %s)" % (
        diff, len(common), sys.argv[3])
    print(text)
    sys.exit(0 if diff <= float(sys.argv[3]) else 1)
print(text)
PY
}
train_of() { echo "'$bin/fulcrum_train' --recipe=$1 --device=cuda --train_iters=$iters --log_interval=1"; }
train=$(train_of tiny)
# Two ranks: one per GPU over NCCL where two are visible, else both on GPU 0 over Gloo with
# host staging (NOTE [host staging]).
if (( gpus >= 2 )); then
  two_ranks="'$bin/fulcrum_launch' --nproc_per_node=2 --master_port=0 --"
  two_ranks_on="nccl, one GPU per rank"
else
  two_ranks="'$bin/fulcrum_launch' --nproc_per_node=2 --master_port=0 --"
  two_ranks_on="gloo with host staging, both ranks on GPU 0"
fi
two_rank_train() {
  local train_cmd
  train_cmd=$(train_of "$1")
  if (( gpus >= 2 )); then
    echo "$two_ranks $train_cmd"
  else
    echo "$two_ranks $train_cmd --device=cuda:0 --distributed_backend=gloo"
  fi
}
# name, GPUs needed, command, reference check, what must have happened (the last two
# optional): metrics go to logs/NAME.jsonl, read by loss_of, compared with
# logs/REFERENCE.jsonl; the check fails with "moves" unless a layer moved, with "overlap"
# unless a gradient bucket started early, with "async" unless a save was committed from the
# background.
train_check() {
  local name=$1 need=$2 command="$3 --metrics_file='$out/logs/$1.jsonl'" reference=${4:-}
  local figures=loss_of
  if [[ -n "$reference" ]]; then
    eval "loss_of_$name() { loss_of \"\$1\" '$out/logs/$reference.log' '${5:-}'; }"
    figures="loss_of_$name"
  fi
  if (( gpus == 0 )); then
    record "$name" "$no_gpu" 0 "$command" ""
  elif (( gpus < need )); then
    record "$name" "not run (needs $need GPUs, $gpus visible)" 0 "$command" ""
  else
    run_check "$name" "$figures" "$command"
  fi
}
train_check train_dense 1 "$train"
train_check train_bf16 1 "$train --bf16"
train_check train_moe 1 "$(train_of tiny_moe)"
train_check train_moe8 1 "$(train_of tiny_moe) --num_layers=8"
for plugin in early_exit freeze "mod --mod_capacity=0.25" "prune --prune_start_iter=0 --prune_end_iter=1" \
              "sparse_attention --sparse_attention_buckets=4"; do
  train_check "train_plugin_${plugin%% *}" 1 "$train --plugins=$plugin"
done
train_check train_freeze_scheduled 1 "$train --plugins=freeze --freeze_schedule='3:0-1'"
train_check train_resume 1 "$train --save='$out/ckpt' && $(train_of tiny | sed "s/--train_iters=$iters/--train_iters=$((iters + 2))/") --load='$out/ckpt'"
# The save of iteration 2 written in the background (NOTE [background saves]): its snapshot is
# a device-to-host copy; the losses are train_dense's, and the log must show its commit.
train_check train_async_save 1 "$train --save='$out/ckpt_async' --save_interval=2 --async_save" train_dense async
# Two ranks ($two_ranks_on), each against its one-process run.
if (( gpus > 0 )); then
  record two_ranks pass 0 "" "the two-rank checks below run over $two_ranks_on"
else
  record two_ranks "$no_gpu" 0 "" ""
fi
train_check train_pp 1 "$(two_rank_train tiny) --pipeline_model_parallel_size=2" train_dense
train_check train_tp 1 "$(two_rank_train tiny) --tensor_model_parallel_size=2" train_dense
train_check train_dp 1 "$(two_rank_train tiny)" train_dense
train_check train_ep 1 "$(two_rank_train tiny_moe) --expert_model_parallel_size=2" train_moe
# Scripted moves (a balancer may find nothing to move in 10 iterations): boundary layers
# between ranks, then per-virtual-stage counts under ZB-V (moves between the two chunks of
# one rank among them).
train_check train_migration 1 "$(two_rank_train tiny) --pipeline_model_parallel_size=2 --rebalance_script='3:1->1;6:2,2'" train_dense moves
# Stage 0's layers frozen after iteration 3: it runs forward only from then on (NOTE
# [forward-only stages]).
train_check train_pp_frozen 1 "$(two_rank_train tiny) --pipeline_model_parallel_size=2 --pipeline_schedule=zbh1 --plugins=freeze --freeze_schedule='3:0-1'" train_freeze_scheduled
train_check train_zbv_moves 1 "$(two_rank_train tiny_moe) --num_layers=8 --pipeline_model_parallel_size=2 --pipeline_schedule=zbv --rebalance_script='2:3,1,1,3;4:1,3,3,1;6:2,2,2,2'" train_moe8 moves
# The distributed optimizer (moments sharded over dp, reduce-scatter and all-gather on the
# device path; NOTE [distributed optimizer]), with layers moving under it; full activation
# recomputation on one GPU (the bf16 path) and at pp=2 with MoE layers under ZB-H1.
train_check train_dp_zero 1 "$(two_rank_train tiny) --use_distributed_optimizer" train_dense
train_check train_zero_moves 1 "$(two_rank_train tiny) --pipeline_model_parallel_size=2 --use_distributed_optimizer --rebalance_script='3:1->1;6:2,2'" train_dense moves
train_check train_recompute 1 "$train --bf16 --recompute_granularity=full" train_bf16
# Sequence parallelism (norms and dropouts on sequence slices, NOTE [sequence parallelism]),
# and the data-parallel reduction overlapped with the backward pass, replicated and
# distributed optimizer (NOTE [overlapped gradient reduction]): small buckets, so several
# start early; each fails unless one did.
train_check train_tp_sp 1 "$(two_rank_train tiny) --tensor_model_parallel_size=2 --sequence_parallel" train_dense
train_check train_dp_overlap 1 "$(two_rank_train tiny) --overlap_grad_reduce --ddp_bucket_size=20000" train_dense overlap
train_check train_zero_overlap 1 "$(two_rank_train tiny) --use_distributed_optimizer --overlap_grad_reduce --ddp_bucket_size=20000" train_dense overlap
train_check train_pp_moe_recompute 1 "$(two_rank_train tiny_moe) --pipeline_model_parallel_size=2 --pipeline_schedule=zbh1 --recompute_granularity=full" train_moe

# --- the report ------------------------------------------------------------------------
python3 - "$results" "$out" "$quick" <<'PY'
import json, sys, datetime
results, out, quick = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
checks = []
for line in open(results):
    name, status, seconds, command, figures = (line.rstrip("\n").split("\t") + [""] * 5)[:5]
    checks.append({"name": name, "status": status, "seconds": int(seconds or 0),
                   "figures": figures.strip(), "command": command})
summary = {s: sum(1 for c in checks if c["status"].startswith(s)) for s in ("pass", "fail", "not run")}
report = {"tool": "tools/gpu_check.sh", "quick": quick,
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
          "summary": summary, "checks": checks}
json.dump(report, open(out + "/report.json", "w"), indent=2)
with open(out + "/report.md", "w") as md:
    md.write("# Fulcrum GPU check%s, %s\n\n" % (" (--quick)" if quick else "", report["date"]))
    md.write("%(pass)d pass, %(fail)d fail, %(not run)d not run.\n\n" % summary)
    md.write("| check | result | seconds | figures | command |\n|---|---|---|---|---|\n")
    for c in checks:
        cell = lambda s: s.replace("|", "\\|")
        md.write("| %s | %s | %d | %s | `%s` |\n" % (c["name"], cell(c["status"]), c["seconds"],
                                                   cell(c["figures"]), cell(c["command"])))
print("gpu_check: %(pass)d pass, %(fail)d fail, %(not run)d not run" % summary)
PY
echo "gpu_check: report in $out/report.md and $out/report.json"
! grep -q $'\tfail\t' "$results"
