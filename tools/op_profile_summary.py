#!/usr/bin/env python3
"""Sums a chrome trace of LibTorch/PyTorch operator events by op name: self time, calls.

Both LibTorch's C++ RecordProfile (fulcrum_bench_train --profile_trace) and
torch.profiler's export_chrome_trace (tools/bench_train_reference.py --trace) write complete
("X") events with a start and a duration per thread. An op's self time is its duration less
that of the events nested directly inside it on the same thread.

  tools/op_profile_summary.py TRACE.json [--steps=3] [--top=25] [--kernels]

With --kernels (a Kineto trace of a GPU run: fulcrum_bench_train --device=cuda
--profile_trace, bench_train_reference.py --device=cuda --trace) it sums the device's own
events instead: each kernel, memcpy and memset by name, grouped into classes (matrix
products, attention, communication, copies, the rest), and the stream's busy time (the
union of its kernels) against the span from the first kernel's start to the last one's end:
the difference is time the GPU sat idle waiting for the host (launch-bound stretches,
synchronisations).
"""
import argparse
import collections
import json


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_class(name, cat):
    """A coarse class of a device event by its name (cuBLAS/cuBLASLt, flash, NCCL, ...)."""
    n = name.lower()
    if cat != "kernel":
        return "copy/memset"
    if "nccl" in n:
        return "communication"
    if any(k in n for k in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(k in n for k in ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "sm80_", "cublas")):
        return "matrix products"
    if any(k in n for k in ("adam", "multi_tensor", "foreach")):
        return "optimizer"
    if any(k in n for k in ("softmax", "nll", "cross_entropy", "log_softmax")):
        return "loss"
    if any(k in n for k in ("norm", "welford")):
        return "norms"
    if "reduce" in n:
        return "reductions"
    return "elementwise/other"


def summarize_kernels(events, steps, top):
    spans = []
    by_name = collections.Counter()
    calls = collections.Counter()
    by_class = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or e.get("cat") not in DEVICE_CATEGORIES:
            continue
        ts, dur = float(e["ts"]), float(e["dur"])
        spans.append((ts, ts + dur))
        by_name[e["name"]] += dur
        calls[e["name"]] += 1
        by_class[kernel_class(e["name"], e.get("cat"))] += dur
    if not spans:
        print("no device events in this trace (a CPU run, or the profiler saw no GPU)")
        return
    spans.sort()
    busy, end = 0.0, spans[0][0]
    for a, b in spans:  # the union of the intervals (streams may overlap)
        if b > end:
            busy += b - max(a, end)
            end = b
    span = spans[-1][1] - spans[0][0]
    total = sum(by_name.values())
    print("%-70s %10s %8s %7s" % ("kernel", "ms/step", "calls", "share"))
    for name, us in by_name.most_common(top):
        print("%-70s %10.2f %8d %6.1f%%" % (name[:70], us / 1e3 / steps, calls[name] // steps,
                                            100.0 * us / total))
    print()
    print("%-30s %10s %7s" % ("class", "ms/step", "share"))
    for name, us in by_class.most_common():
        print("%-30s %10.2f %6.1f%%" % (name, us / 1e3 / steps, 100.0 * us / total))
    print()
    print("device busy %.2f ms/step of a %.2f ms/step span (idle %.1f%%); kernel time summed "
          "%.2f ms/step" % (busy / 1e3 / steps, span / 1e3 / steps,
                            100.0 * (span - busy) / span, total / 1e3 / steps))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=3, help="steps the trace holds (per-step ms)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--kernels", action="store_true",
                   help="sum the device's kernels, copies and memsets instead of host ops")
    args = p.parse_args()
    with open(args.trace) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    if args.kernels:
        summarize_kernels(events, args.steps, args.top)
        return
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
