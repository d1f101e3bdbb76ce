#!/usr/bin/env bash
# Call 3 (after ../2026-11-26c/stage.sh): tools/gpu_check.sh --quick --no-bench on the
# binaries of the stop's last code (858eb80: the balancers under chunks changed since call 1).
set -uo pipefail
source docs/gpu-runs/device_env.sh
tools/gpu_check.sh --quick --no-bench --no-build --build-dir /work/main/build --check-timeout 150 "$out/chk"
rc=$?
echo "gpu_check rc=$rc after $((SECONDS - t0)) s"
cat "$out/chk/report.md"
exit $rc
