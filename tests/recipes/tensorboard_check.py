#!/usr/bin/env python3
"""Reads a --tensorboard_dir back with TensorBoard (PyPI's `tensorboard`) and compares every
scalar with the --metrics_file of the same run.

The tags expected of a metrics record are worked out here from the table that
core/metrics.h documents (TensorBoardScalars), independently of the C++ code. TensorBoard's
EventAccumulator must hold exactly those tags, each with exactly the iterations of the
metrics file as steps, in order, and the values to float32 precision. Where a resumed run
wrote some iterations twice, the metrics file holds both lines and the later one counts, as
TensorBoard counts the later file (NOTE [tensorboard resume] in core/tensorboard_writer.h).

Each event file is also read record by record: its first event must be file_version
"brain.Event:2", each record's framing must be the one TensorBoard's own RecordWriter makes
of the same payload, and each payload must be what protobuf itself serializes for the
event it parses to.

Prints "OK: ..." and the sorted tags and exits 0, or prints the differences and exits 1.
"""

import argparse
import io
import json
import math
import os
import struct
import sys

try:
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter
except ImportError as error:  # a failure, not a skip: tools/setup.sh installs it
    print(f"cannot import tensorboard ({error}); tools/setup.sh pip-installs it", file=sys.stderr)
    sys.exit(1)

RENAMED = {
    "loss": ("lm loss", 1.0),
    "lr": ("learning-rate", 1.0),
    "grad_norm": ("grad-norm", 1.0),
    "iteration_ms": ("iteration-time", 1e-3),
    "valid_loss": ("lm loss validation", 1.0),
    "tokens_per_second": ("tokens-per-second", 1.0),
    "consumed_samples": ("consumed-samples", 1.0),
    "bubble_ratio": ("pipeline/bubble-ratio", 1.0),
    "bubble_ratio_max": ("pipeline/bubble-ratio-max", 1.0),
    "bubble_ratio_in_run": ("pipeline/bubble-ratio-in-run", 1.0),
    "imbalance": ("pipeline/imbalance", 1.0),
    "pipeline_ms": ("pipeline/pipeline-ms", 1.0),
    "activation_peak_mb": ("pipeline/activation-peak-mb", 1.0),
    "layers_moved": ("pipeline/layers-moved", 1.0),
}
PER_STAGE = {"stage_ms": "-load-ms", "stage_bubble_ratio": "-bubble-ratio"}


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def expected_scalars(record):
    """{tag: value} of one metrics record, per core/metrics.h."""
    out = {}
    for field, value in record.items():
        if field == "iteration":
            continue
        if is_number(value):
            tag, factor = RENAMED.get(field, (field, 1.0))
            out[tag] = value * factor
            if field == "valid_loss":
                out["lm loss validation ppl"] = math.exp(value)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if is_number(item):
                    tag = (f"pipeline/stage{i}{PER_STAGE[field]}" if field in PER_STAGE
                           else f"{field}/{i}")
                    out[tag] = item
        elif isinstance(value, dict):
            for key, item in value.items():
                if is_number(item):
                    out[f"{field}/{key}"] = item
    return out


def read_records(path):
    """The payloads of the TFRecords of `path`, with their framed bytes."""
    with open(path, "rb") as f:
        data = f.read()
    records, at = [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        end = at + 12 + length + 4
        if end > len(data):
            raise ValueError(f"{path}: record at byte {at} runs past the end")
        records.append((data[at + 12:at + 12 + length], data[at:end]))
        at = end
    return records


def check_files(logdir, problems):
    names = sorted(n for n in os.listdir(logdir) if "tfevents" in n)
    for name in names:
        path = os.path.join(logdir, name)
        records = read_records(path)
        if not records:
            problems.append(f"{name}: no records")
            continue
        for index, (payload, framed) in enumerate(records):
            reference = io.BytesIO()
            RecordWriter(reference).write(payload)
            if reference.getvalue() != framed:
                problems.append(
                    f"{name}: record {index} is framed unlike TensorBoard's RecordWriter")
            event = event_pb2.Event.FromString(payload)
            if event.SerializeToString(deterministic=True) != payload:
                problems.append(f"{name}: record {index} is not protobuf's own encoding of {event}")
            if index == 0 and event.file_version != "brain.Event:2":
                problems.append(f"{name}: first event is not file_version brain.Event:2: {event}")
    return names


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--metrics", required=True)
    args = parser.parse_args()

    records = {}
    with open(args.metrics) as f:
        for line in f:
            record = json.loads(line)
            records[record["iteration"]] = record  # a later line replaces an earlier one
    expected = {}  # tag -> [(step, value)]
    for step in sorted(records):
        for tag, value in expected_scalars(records[step]).items():
            expected.setdefault(tag, []).append((step, value))

    problems = []
    files = check_files(args.logdir, problems)
    accumulator = event_accumulator.EventAccumulator(
        args.logdir, size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    got_tags = set(accumulator.Tags()["scalars"])
    for tag in sorted(got_tags - set(expected)):
        problems.append(f"tag {tag!r} is in TensorBoard but not in the metrics file")
    for tag in sorted(set(expected) - got_tags):
        problems.append(f"tag {tag!r} of the metrics file is missing from TensorBoard")
    count = 0
    for tag in sorted(got_tags & set(expected)):
        got = [(e.step, e.value) for e in accumulator.Scalars(tag)]
        want = expected[tag]
        if [s for s, _ in got] != [s for s, _ in want]:
            problems.append(
                f"{tag!r}: steps {[s for s, _ in got]}, expected {[s for s, _ in want]}")
            continue
        for (step, value), (_, reference) in zip(got, want):
            # simple_value is a float32: the stored value is the reference rounded to float32.
            single = struct.unpack("<f", struct.pack("<f", reference))[0]
            if not math.isclose(value, single, rel_tol=1e-6, abs_tol=0.0):
                problems.append(f"{tag!r} at step {step}: {value!r}, expected {reference!r}")
            count += 1
    if problems:
        print(f"{len(problems)} problem(s):")
        for problem in problems[:50]:
            print("  " + problem)
        return 1
    steps = sorted(records)
    print(f"OK: {count} scalars, {len(got_tags)} tags, steps {steps[0]}..{steps[-1]}, "
          f"{len(files)} event file(s)")
    for tag in sorted(got_tags):
        print(f"tag {tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
