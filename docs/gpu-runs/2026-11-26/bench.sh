#!/usr/bin/env bash
set -uo pipefail
site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
nv=$(ls -d "$site"/nvidia/*/lib 2>/dev/null | paste -sd:)
export LD_LIBRARY_PATH="$site/torch/lib:$nv:/usr/local/cuda/lib64:/tmp/fulcrum-prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p /tmp/fulcrum-prefix && for f in .gpubundle/*.deb; do dpkg -x "$f" /tmp/fulcrum-prefix; done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 280 .gpubuild/bin/fulcrum_bench_train --device=cuda --bf16 --compare_reference --reference_python=python3 \
  --reference_script="$PWD/tools/bench_train_reference.py" --rounds=3 --iters_per_round=4 --warmup_iters=2 2>&1 | grep -v "^I2026\|^W2026"
echo "bench rc=${PIPESTATUS[0]}"
