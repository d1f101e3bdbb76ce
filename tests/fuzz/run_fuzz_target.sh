#!/usr/bin/env bash
# run_fuzz_target.sh TARGET SEEDS BUILD_DIR SECONDS: fuzzes TARGET (<name>_fuzz) on one core
# for SECONDS, from the seed corpus SEEDS (read only; new inputs go to
# BUILD_DIR/corpus/<name>) with the dictionary <name>.dict beside this script, if there is
# one. Exits non-zero, with libFuzzer's report and the input in BUILD_DIR/artifacts/<name>/,
# when an input crashes, leaks, trips a sanitizer, runs over 10 s or takes over 2 GB.
set -euo pipefail
target=$1 seeds=$2 build=$3 seconds=$4
name=$(basename "$target" _fuzz)
mkdir -p "$build/corpus/$name" "$build/artifacts/$name"
# The target's dictionary (tests/fuzz/<name>.dict), the words of its format, if it has one.
dict=$(dirname "$0")/$name.dict
dict_flag=()
[ -f "$dict" ] && dict_flag=(-dict="$dict")
exec "$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
  -print_final_stats=1 -artifact_prefix="$build/artifacts/$name/" "${dict_flag[@]}" \
  "$build/corpus/$name" "$seeds"
