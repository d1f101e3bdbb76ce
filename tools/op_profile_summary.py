#!/usr/bin/env python3
"""Sums a chrome trace of LibTorch/PyTorch operator events by op name: self time, calls.

Both LibTorch's C++ RecordProfile (fulcrum_bench_train --profile_trace) and
torch.profiler's export_chrome_trace (tools/bench_train_reference.py --trace) write complete
("X") events with a start and a duration per thread. An op's self time is its duration less
that of the events nested directly inside it on the same thread.

  tools/op_profile_summary.py TRACE.json [--steps=3] [--top=25]
"""
import argparse
import collections
import json


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=3, help="steps the trace holds (per-step ms)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    with open(args.trace) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if e.get("cat") not in (None, "cpu_op", "Operator", "operator"):
            continue
        by_thread[e.get("tid")].append((float(e["ts"]), float(e["dur"]), e["name"]))
    self_us = collections.Counter()
    calls = collections.Counter()
    total = 0.0
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack = []  # [end, name, child time]
        def pop_until(ts):
            nonlocal total
            while stack and stack[-1][0] <= ts:
                end, name, start, child = stack.pop()
                self_us[name] += (end - start) - child
                if stack:
                    stack[-1][3] += end - start
                else:
                    total += end - start
        for ts, dur, name in spans:
            pop_until(ts)
            calls[name] += 1
            stack.append([ts + dur, name, ts, 0.0])
        pop_until(float("inf"))
    print("%-45s %10s %8s %7s" % ("op", "ms/step", "calls", "share"))
    for name, us in self_us.most_common(args.top):
        print("%-45s %10.2f %8d %6.1f%%" % (name[:45], us / 1e3 / args.steps,
                                            calls[name] // args.steps, 100.0 * us / max(total, 1)))
    print("%-45s %10.2f" % ("total (outermost ops)", total / 1e3 / args.steps))


if __name__ == "__main__":
    main()
