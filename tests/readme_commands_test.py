#!/usr/bin/env python3
"""Runs every command README.md shows, and fails if one exits non-zero.

A command is a line of a fenced ```bash block that starts with `build/bin/`, `tools/` or
`.venv/bin/python` (continued over lines ending in a backslash; a trailing `# comment` is
dropped). Each block runs in a fresh scratch directory in which `build` points at the build
tree and `.venv` and `tests` at the repository's, its commands in order, so a later command
may read what an earlier one wrote (a metrics file, a trace, a converted checkpoint).

An HTML comment right before a block (invisible on the rendered page) adapts it to a test:

    <!-- readme-test: append="--train_iters=10" setup="printf ... > my.flags" -->

  append=FLAGS   appended to every command of the block that runs fulcrum_train (directly or
                 under fulcrum_launch), to shorten a long run; later gflags win
  append_sim=FLAGS  the same for the block's fulcrum_sim commands (fewer simulated iterations)
  setup=SHELL    run (bash) in the scratch directory before the block, for input files a
                 user would bring (a corpus, a flag file)
  skip=REASON    the block is not run here; REASON must say what runs it instead

Usage: readme_commands_test.py --readme README.md --build BUILD_DIR [--only SUBSTRING]
"""
import argparse
import os
import re
import shlex
import subprocess
import shutil
import sys
import tempfile
import time

MARKER = re.compile(r"<!--\s*readme-test:(.*?)-->")
COMMAND_PREFIXES = ("build/bin/", "tools/", ".venv/bin/python")
TIMEOUT_S = 600


class Block:
    def __init__(self, line, directives):
        self.line = line  # README line of the opening fence
        self.directives = directives
        self.commands = []  # (README line, argv)


def parse_directives(text, line):
    directives = {}
    for item in shlex.split(text):
        key, sep, value = item.partition("=")
        if not sep or key not in ("append", "append_sim", "setup", "skip"):
            sys.exit(f"README.md:{line}: readme-test: unknown directive '{item}' "
                     "(append=, append_sim=, setup=, skip=)")
        directives[key] = value
    if "skip" in directives and not directives["skip"].strip():
        sys.exit(f"README.md:{line}: readme-test: skip= must say what runs the block instead")
    return directives


def parse_readme(path):
    """The ```bash blocks of README.md and their commands."""
    lines = open(path, encoding="utf-8").read().split("\n")
    blocks, pending, block, continued = [], None, None, None
    for number, text in enumerate(lines, start=1):
        stripped = text.strip()
        if block is None:
            marker = MARKER.search(stripped)
            if marker:
                pending = (parse_directives(marker.group(1), number), number)
            elif stripped.startswith("```"):
                if stripped == "```bash":
                    directives = pending[0] if pending and pending[1] >= number - 2 else {}
                    block = Block(number, directives)
                else:
                    block = Block(number, {"skip": "not a bash block"})
                pending = None
            continue
        if stripped.startswith("```"):
            if continued is not None:
                sys.exit(f"README.md:{continued[0]}: the command continues past its block")
            if block.directives.get("skip") != "not a bash block":
                blocks.append(block)
            block = None
            continue
        if continued is None and not stripped.startswith(COMMAND_PREFIXES):
            continue
        joined = (continued[1] + " " if continued else "") + stripped
        start = continued[0] if continued else number
        if joined.endswith("\\"):
            continued = (start, joined[:-1].rstrip())
            continue
        continued = None
        block.commands.append((start, shlex.split(joined, comments=True)))
    return blocks


def runs(argv, binary):
    return any(os.path.basename(arg) == binary for arg in argv)


def run_block(block, build_dir, repo, failures):
    reason = block.directives.get("skip")
    if reason:
        print(f"README.md:{block.line}: skipped ({reason})", flush=True)
        return 0
    scratch = tempfile.mkdtemp(prefix=f"readme_{block.line}_")
    failed_before = len(failures)
    ran = run_block_in(block, scratch, build_dir, repo, failures)
    if len(failures) == failed_before:
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"README.md:{block.line}: its files are kept in {scratch}", flush=True)
    return ran


def run_block_in(block, scratch, build_dir, repo, failures):
    """Runs the block's commands in `scratch` (the build, venv and tests linked in)."""
    os.symlink(build_dir, os.path.join(scratch, "build"))
    for name in (".venv", "tests"):
        if os.path.exists(os.path.join(repo, name)):
            os.symlink(os.path.join(repo, name), os.path.join(scratch, name))
    env = dict(os.environ)
    if "setup" in block.directives:
        setup = subprocess.run(["bash", "-euo", "pipefail", "-c", block.directives["setup"]],
                               cwd=scratch, env=env, capture_output=True, text=True)
        if setup.returncode != 0:
            failures.append(f"README.md:{block.line}: setup failed ({setup.returncode}):\n"
                            f"{setup.stdout}{setup.stderr}")
            return 0
    appended = {"fulcrum_train": shlex.split(block.directives.get("append", "")),
                "fulcrum_sim": shlex.split(block.directives.get("append_sim", ""))}
    ran = 0
    for line, argv in block.commands:
        for binary, flags in appended.items():
            if flags and runs(argv, binary):
                argv = argv + flags
        if argv[0].startswith(COMMAND_PREFIXES[0]) and not os.path.exists(
                os.path.join(build_dir, argv[0][len("build/"):])):
            failures.append(f"README.md:{line}: {argv[0]} is not built")
            continue
        start = time.monotonic()
        try:
            result = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True,
                                    timeout=TIMEOUT_S)
            code, output = result.returncode, result.stdout + result.stderr
        except subprocess.TimeoutExpired as e:
            code, output = "timeout", f"(no exit after {TIMEOUT_S} s)"
        seconds = time.monotonic() - start
        ran += 1
        shown = shlex.join(argv)
        print(f"README.md:{line}: exit {code} in {seconds:.1f} s: {shown}", flush=True)
        if code != 0:
            tail = "\n".join(output.rstrip().split("\n")[-25:])
            failures.append(f"README.md:{line}: exit {code}: {shown}\n{tail}")
    return ran


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--readme", required=True)
    parser.add_argument("--build", required=True, help="the build directory (holds bin/)")
    parser.add_argument("--only", default="", help="run only commands containing this")
    args = parser.parse_args()
    build_dir = os.path.abspath(args.build)
    blocks = parse_readme(args.readme)
    if args.only:
        for block in blocks:
            block.commands = [c for c in block.commands if args.only in " ".join(c[1])]
    failures, ran = [], 0
    for block in blocks:
        ran += run_block(block, build_dir, os.path.dirname(os.path.abspath(args.readme)),
                         failures)
    total = sum(len(b.commands) for b in blocks)
    print(f"{ran} README commands run ({total} found in {len(blocks)} bash blocks), "
          f"{len(failures)} failed")
    for failure in failures:
        print("\nFAILED " + failure)
    if ran == 0:
        print("no README command ran: the README or the filter changed")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
