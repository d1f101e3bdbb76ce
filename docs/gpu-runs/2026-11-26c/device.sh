#!/usr/bin/env bash
# Runs on the device machine from the repository root (third GPU session, 2026-11-26).
# The binaries in .gpubuild/bin were built on the CPU machine (FULCRUM_CUDA=ON, sm_75 +
# PTX) and run against the machine's own torch 2.11 libraries; .gpubundle holds Fulcrum's
# other runtime packages (tools/gpu_bundle.sh). Three measurements, most wanted first:
#  1. per-layer timing overhead: fulcrum_bench_pipeline --layer_timing_overhead, pp=2 with
#     both ranks on GPU 0 over Gloo with host staging (NOTE [host staging]);
#  2. fulcrum_bench_train --device=cuda --bf16 --compare_reference with a Kineto profile of
#     3 Fulcrum steps, summed per kernel (tools/op_profile_summary.py --kernels);
#  3. the same for torch.compile's step (tools/bench_train_reference.py --trace).
set -uo pipefail
t0=$SECONDS
root=$PWD
out=${OUT:-/tmp/out}
mkdir -p "$out"
[[ -e build ]] || ln -s .gpubuild build
site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
echo "torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())')"
nv=$(ls -d "$site"/nvidia/*/lib 2>/dev/null | paste -sd:)
export LD_LIBRARY_PATH="$site/torch/lib:$nv:/usr/local/cuda/lib64:/tmp/fulcrum-prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p /tmp/fulcrum-prefix && for f in .gpubundle/*.deb; do dpkg -x "$f" /tmp/fulcrum-prefix; done
nvidia-smi -L
ldd build/bin/fulcrum_train | grep -E "not found" && echo "MISSING LIBRARIES"

step() { echo "== $1 (at $((SECONDS - t0)) s)"; }

step "1. per-layer timing overhead"
timeout 200 build/bin/fulcrum_bench_pipeline --pp=2 --schedules=zbh1 --microbatches=8 \
  --micro_batch_size=2 --train_iters=10 --skip_iters=3 --layer_timing_overhead \
  --overhead_rounds=3 --recipe=tiny \
  --model_flags="--device=cuda:0 --distributed_backend=gloo --bf16 --num_layers=12 --hidden_size=2048 --num_attention_heads=16 --seq_length=2048" \
  > "$out/layer_timing_overhead.txt" 2>&1
echo "rc=$?"; tail -12 "$out/layer_timing_overhead.txt"

step "2. fulcrum_bench_train with a Kineto profile"
timeout 260 build/bin/fulcrum_bench_train --device=cuda --bf16 --compare_reference \
  --reference_python=python3 --quick --profile_trace="$out/prof" > "$out/bench_train.txt" 2>&1
echo "rc=$?"; tail -12 "$out/bench_train.txt"
python3 tools/op_profile_summary.py "$out/prof.gpt_1p3b.json" --kernels --top=40 \
  > "$out/kernels_fulcrum.txt" 2>&1
python3 tools/op_profile_summary.py "$out/prof.gpt_1p3b.json" --top=40 > "$out/ops_fulcrum.txt" 2>&1
tail -14 "$out/kernels_fulcrum.txt"

step "3. torch.compile's step, profiled"
timeout 150 python3 tools/bench_train_reference.py --layers=24 --hidden=2048 --heads=16 \
  --ffn=8192 --seq=2048 --micro_batch=2 --global_batch=8 --vocab=50304 --device=cuda --bf16 \
  --compile --warmup=3 --trace="$out/ref_compile.json" > "$out/ref_compile.log" 2>&1
echo "rc=$?"
python3 tools/op_profile_summary.py "$out/ref_compile.json" --kernels --top=40 \
  > "$out/kernels_torch_compile.txt" 2>&1
tail -14 "$out/kernels_torch_compile.txt"

# Keep the traces only compressed (each is tens of MB of JSON).
for f in "$out"/prof.gpt_1p3b.json "$out"/ref_compile.json; do [[ -f $f ]] && gzip -9 "$f"; done
ls -la "$out"
echo "done after $((SECONDS - t0)) s"
