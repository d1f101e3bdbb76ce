#!/usr/bin/env python3
"""How long a pipeline hand-over takes in a real run, from its --timeline file.

For every action that waited for its input (an F for the activation from the stage before, a
B or BW for the gradient from the stage after), the hand-over latency is the end of that wait
minus the end of the action on the neighbouring stage that produced the input. Both come from
one host's steady clock, so the figure is exact up to the ranks' time-origin offset (NOTE
[timeline clock] in pipeline/timeline.h: 1-300 us on loopback). One chunk per stage and one
rank per stage (pp only); iterations before --skip are start-up and left out.

  python3 tools/handover_latency.py TIMELINE.json [--skip=2] [--min_wait_us=50]

Prints the count and the median, 10th and 90th percentile, in ms. fulcrum_sim models a
hand-over as p2p latency + bytes / bandwidth on top of the producing action; a median near
zero says the transfer is inside the producer's measured time (what --p2p_bytes=0 models).
"""
import argparse
import json
import statistics
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline")
    parser.add_argument("--skip", type=int, default=2, help="iterations 1..skip are left out")
    parser.add_argument("--min_wait_us", type=float, default=50,
                        help="waits shorter than this are not hand-overs the stage waited for")
    args = parser.parse_args()
    with open(args.timeline) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    actions = {}  # (rank, iteration, kind, microbatch) -> event
    for e in events:
        if e.get("cat") != "compute":
            continue
        a = e["args"]
        if a.get("chunk", 0) != 0:
            sys.exit("handover_latency: a timeline with model chunks; only one chunk per stage is supported")
        actions[(e["pid"], a["iteration"], a["kind"], a["microbatch"])] = e
    ranks = 1 + max((k[0] for k in actions), default=0)
    latencies = []
    for e in events:
        if e.get("cat") != "wait" or "for" not in e.get("args", {}):
            continue
        rank, iteration = e["pid"], e["args"]["iteration"]
        if iteration <= args.skip or e["dur"] < args.min_wait_us:
            continue
        waiter = [a for k, a in actions.items()
                  if k[0] == rank and k[1] == iteration and a["name"] == e["args"]["for"]
                  and a["ts"] <= e["ts"] + 1e-3 <= a["ts"] + a["dur"] + 1e-3]
        if not waiter:
            continue
        w = waiter[0]["args"]
        if w["kind"] == "F":
            source = [(rank - 1, iteration, "F", w["microbatch"])] if rank > 0 else []
        else:
            source = [(rank + 1, iteration, kind, w["microbatch"]) for kind in ("B", "BW")
                      if rank + 1 < ranks]
        producer = [actions[k] for k in source if k in actions]
        if not producer:
            continue
        p = producer[0]
        latencies.append(((e["ts"] + e["dur"]) - (p["ts"] + p["dur"])) / 1000.0)
    if not latencies:
        sys.exit("handover_latency: no action waited for a hand-over (after --skip)")
    latencies.sort()
    n = len(latencies)
    print("%d hand-overs waited for: latency median %.3f ms, p10 %.3f, p90 %.3f"
          % (n, statistics.median(latencies), latencies[n // 10], latencies[(9 * n) // 10]))


if __name__ == "__main__":
    main()
