#!/usr/bin/env bash
# Runs on the device machine from the repository root: the binaries in .gpubuild were built
# on the CPU machine (FULCRUM_CUDA=ON, sm_75 + PTX) in /work/p211/build; their ctest files name
# that path, so /work/p211 is made to point here.
set -uo pipefail
t0=$SECONDS
root=$PWD
mkdir -p /work
if [[ ! -e /work/p211 ]]; then ln -s "$root" /work/p211; fi
[[ -e build ]] || ln -s .gpubuild build
ls -la /work/p211/build/ | head -3
site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
echo "site-packages: $site; torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())')"
nv=$(ls -d "$site"/nvidia/*/lib 2>/dev/null | paste -sd:)
export LD_LIBRARY_PATH="$site/torch/lib:$nv:/usr/local/cuda/lib64:/tmp/fulcrum-prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p /tmp/fulcrum-prefix && for f in .gpubundle/*.deb; do dpkg -x "$f" /tmp/fulcrum-prefix; done
nvidia-smi -L; nvcc --version | tail -2; cmake --version | head -1; g++ --version | head -1
echo "--- ldd fulcrum_train"; ldd build/bin/fulcrum_train | grep -E "not found|torch|nccl|cudart|cublas|glog"
tools/gpu_check.sh --quick --no-build --build-dir /work/p211/build --check-timeout 150 /tmp/chk
rc=$?
echo "gpu_check rc=$rc after $((SECONDS - t0)) s"
# pp=2 with both ranks on the one GPU (issue 23 item 7: "where NCCL allows it").
echo "--- pp=2, both ranks on cuda:0 (nccl)"
timeout --kill-after=5 90 build/bin/fulcrum_launch --nproc_per_node=2 --master_port=0 -- build/bin/fulcrum_train --recipe=tiny --device=cuda:0 --pipeline_model_parallel_size=2 --train_iters=3 --log_interval=1 > /tmp/chk/logs/pp2_one_gpu.log 2>&1
echo "pp2 one gpu rc=$?"; grep -E "iteration|Error|error|refus|Duplicate" /tmp/chk/logs/pp2_one_gpu.log | head -12
# With the time left: does the CUDA build configure (and compile the kernels) on this machine for sm_90?
left=$(( ${DEVICE_BUDGET_S:-540} - (SECONDS - t0) ))
if (( left > 60 )); then
  torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  timeout $((left - 20)) bash -c "cmake -S . -B /tmp/fb -G Ninja -DCMAKE_BUILD_TYPE=Release -DFULCRUM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH='$torch_prefix;/tmp/fulcrum-prefix/usr' -DCMAKE_LIBRARY_PATH=/tmp/fulcrum-prefix/usr/lib/x86_64-linux-gnu -DCMAKE_INCLUDE_PATH=/tmp/fulcrum-prefix/usr/include > /tmp/chk/logs/device_configure.log 2>&1 && echo configure-ok && cmake --build /tmp/fb -j16 --target core_kernels_test > /tmp/chk/logs/device_build.log 2>&1 && echo build-kernels-ok && LD_LIBRARY_PATH=$LD_LIBRARY_PATH /tmp/fb/bin/core_kernels_test --gtest_filter='*Cuda*' 2>&1 | tail -15"
  echo "device build step rc=$? after $((SECONDS - t0)) s"; tail -5 /tmp/chk/logs/device_configure.log
fi
exit $rc
