#!/usr/bin/env bash
# Call 2 on the device machine (after stage.sh): the GPU tests and the short training runs
# of tools/gpu_check.sh on the binaries with this session's GPU changes (fused AdamW, the
# gradient norm on the device, no host waits inside a step, the GEMM accumulating into
# .grad, compute copies of the weights), then fulcrum_bench_train with a Kineto profile.
set -uo pipefail
t0=$SECONDS
root=$PWD
out=${OUT:-/tmp/out}
mkdir -p /work "$out"
[[ -e /work/main ]] || ln -s "$root" /work/main
[[ -e build ]] || ln -s .gpubuild build
site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
nv=$(ls -d "$site"/nvidia/*/lib 2>/dev/null | paste -sd:)
export LD_LIBRARY_PATH="$site/torch/lib:$nv:/usr/local/cuda/lib64:/tmp/fulcrum-prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p /tmp/fulcrum-prefix && for f in .gpubundle/*.deb; do dpkg -x "$f" /tmp/fulcrum-prefix; done
nvidia-smi -L
echo "== gpu_check (at $((SECONDS - t0)) s)"
tools/gpu_check.sh --quick --no-bench --no-build --build-dir /work/main/build --check-timeout 120 "$out/chk"
echo "gpu_check rc=$?"
grep -E "\| (pass|fail)" "$out/chk/report.md" | cut -d'|' -f2-5 | cut -c1-230
grep -h "worst relative\|GpuBf16\|FusedMatches" "$out"/chk/logs/*.log 2>/dev/null | head -5
echo "== bench_train with a Kineto profile (at $((SECONDS - t0)) s)"
timeout 260 build/bin/fulcrum_bench_train --device=cuda --bf16 --compare_reference \
  --reference_python=python3 --quick --profile_trace="$out/prof" > "$out/bench_train.txt" 2>&1
echo "rc=$?"; tail -12 "$out/bench_train.txt"
python3 tools/op_profile_summary.py "$out/prof.gpt_1p3b.json" --kernels --top=40 > "$out/kernels_fulcrum.txt" 2>&1
python3 tools/op_profile_summary.py "$out/prof.gpt_1p3b.json" --top=40 > "$out/ops_fulcrum.txt" 2>&1
tail -12 "$out/kernels_fulcrum.txt"
[[ -f "$out/prof.gpt_1p3b.json" ]] && gzip -9 "$out/prof.gpt_1p3b.json"
echo "done after $((SECONDS - t0)) s"
