#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains the default recipe (`tiny`)
# on the embedded corpus, showing the loss fall and where the checkpoint went.
# Extra arguments go to fulcrum_train (e.g. tools/demo.sh --train_iters=100).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
fulcrum_install_packages
fulcrum_build --target fulcrum_train fulcrum_ckpt

out="${FULCRUM_DEMO_DIR:-$FULCRUM_ROOT/demo_run}"
rm -rf "$out" && mkdir -p "$out"
echo "fulcrum: training the tiny recipe on the embedded corpus (about half a minute on 2 cores)"
"$FULCRUM_BUILD_DIR/bin/fulcrum_train" --recipe=tiny --save="$out/checkpoints" \
  --metrics_file="$out/metrics.jsonl" "$@"

first=$(head -n 1 "$out/metrics.jsonl" | sed -E 's/.*"loss":([0-9.eE+-]+).*/\1/')
last=$(tail -n 1 "$out/metrics.jsonl" | sed -E 's/.*"loss":([0-9.eE+-]+).*/\1/')
echo
echo "fulcrum: loss fell from $first (first iteration) to $last (last iteration)"
echo "fulcrum: per-iteration metrics: $out/metrics.jsonl"
echo "fulcrum: checkpoint: $out/checkpoints/$(cat "$out/checkpoints/latest")"
"$FULCRUM_BUILD_DIR/bin/fulcrum_ckpt" verify "$out/checkpoints"
