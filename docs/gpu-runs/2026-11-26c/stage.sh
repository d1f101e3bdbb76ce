#!/usr/bin/env bash
# Stages the CPU machine's CUDA build (build/, FULCRUM_CUDA=ON) into .gpubuild for the device
# machine: the binaries the GPU checks run and the ctest files of the test binaries among
# them (their paths name /work/main/build; device.sh points /work/main at the carried tree).
set -euo pipefail
cd "$(dirname "$0")/../../.."
tests=(core_test core_kernels_test parallel_test moe_test pipeline_engine_test)
tools=(fulcrum_train fulcrum_launch fulcrum_bench_train fulcrum_bench_pipeline)
rm -rf .gpubuild && mkdir -p .gpubuild/bin .gpubuild/tests
for b in "${tests[@]}" "${tools[@]}"; do cp build/bin/$b .gpubuild/bin/; done
echo 'subdirs("tests")' > .gpubuild/CTestTestfile.cmake
{
  grep -v '^include(' build/tests/CTestTestfile.cmake
  for b in "${tests[@]}"; do grep "^include(\"/work/main/build/tests/${b}\[" build/tests/CTestTestfile.cmake; done
} > .gpubuild/tests/CTestTestfile.cmake
for b in "${tests[@]}"; do cp build/tests/"${b}"\[*_include.cmake build/tests/"${b}"\[*_tests.cmake .gpubuild/tests/ 2>/dev/null || true; done
du -sh .gpubuild
