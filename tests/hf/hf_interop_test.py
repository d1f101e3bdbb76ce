#!/usr/bin/env python3
"""SlowHfInterop: Fulcrum's Hugging Face import and export, proven against transformers.

For each architecture (tests/hf/hf_reference.py makes a tiny seeded model with
transformers' own save_pretrained):
  1. fulcrum_ckpt import-hf HF_DIR CKPT
  2. build/bin/fulcrum_hf_logits on CKPT and hf_reference.py `reference` on HF_DIR, on the
     same tokens: logits, loss and the loss after one AdamW step agree within 1e-5
     (relative; NOTE [hf comparison file] in hf_reference.py)
  3. fulcrum_ckpt export-hf CKPT OUT, then `check-export`: transformers' from_pretrained
     loads OUT with no warning and its logits agree with Fulcrum's within 1e-5 (and, for
     llama, the same export without model.norm.weight must fail that check)
  4. negative controls: the same model with one deliberate conversion mistake (GPT-2's
     Conv1D weights not transposed, a wrong rope base, rotary rows permuted, gate and up
     swapped) must miss Fulcrum's logits by more than 10× the tolerance: the tolerance has
     teeth for each mistake a converter is likely to make
Then bad inputs: a missing shard, a tensor of the wrong shape, an unknown architecture and
a sliding window must each make import-hf exit 2 and write nothing.

Missing transformers, binaries or a failing step fail the test; nothing is skipped
(tools/setup.sh installs transformers). Run by ctest (tests/CMakeLists.txt) as
  python hf_interop_test.py --build BUILD_DIR [--cases gpt2,llama] [--keep DIR]
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "hf_reference.py")

# One AdamW step's hyper-parameters, the same on both sides; a large learning rate and
# weight decay so the step visibly changes the loss and the decay grouping matters.
ADAM = ["--lr=0.01", "--weight_decay=0.1", "--adam_beta1=0.9", "--adam_beta2=0.95",
        "--adam_eps=1e-8"]

# name: (hf_reference.py make arguments, negative controls: perturb kinds)
CASES = {
    # Today's GPT: plain GeLU (exact erf), LayerNorm, learned positions, tied embeddings.
    "gpt2_gelu": (["--arch", "gpt2", "--activation", "gelu"], ["conv1d_transpose"]),
    # GPT-2 as published: gelu_new (--openai_gelu).
    "gpt2": (["--arch", "gpt2"], ["conv1d_transpose", "activation"]),
    # GQA 4 heads / 2 groups, RMSNorm, SwiGLU, rope, untied head; sharded with an index.
    "llama": (["--arch", "llama", "--shards", "3", "--rope_theta", "50000"],
              ["rope_base", "qk_permute", "gate_up_swap"]),
    # A hub-style config.json (transformers 4: top-level rope_theta) and tied embeddings.
    "llama_v4_tied": (["--arch", "llama", "--v4_config", "--tie", "--rope_theta", "50000"],
                      ["rope_base"]),
    # 4 experts, top-2, SwiGLU experts.
    "mixtral": (["--arch", "mixtral"], ["gate_up_swap", "rope_base"]),
    # The same with transformers 5's fused expert tensors (gate_up_proj [E, 2F, h]).
    "mixtral_fused": (["--arch", "mixtral", "--fused_experts"], []),
}
DEFAULT_CASES = "gpt2_gelu,gpt2,llama,llama_v4_tied,mixtral,mixtral_fused"


class Failure(Exception):
    pass


class Runner:
    def __init__(self, args, work):
        self.python = args.python
        self.bin = os.path.join(args.build, "bin")
        self.work = work
        self.server = None  # hf_reference.py serve, started on the first reference call
        self.env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    def path(self, *parts):
        return os.path.join(self.work, *parts)

    def run(self, argv, expect_rc=0, what=""):
        start = time.time()
        proc = subprocess.run(argv, env=self.env, cwd=self.work, capture_output=True, text=True)
        self.report(proc, time.time() - start, expect_rc, what)
        return proc

    def report(self, proc, took, expect_rc, what):
        shown = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(proc.args))
        print(f"[{took:5.1f} s] rc={proc.returncode} {shown}", flush=True)
        if proc.returncode != expect_rc:
            raise Failure(f"{what or shown}: exit {proc.returncode}, expected {expect_rc}\n"
                          f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")

    def close(self):
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait()
            self.server = None

    def reference(self, *args, expect_rc=0, what=""):
        """hf_reference.py ARGS, run by its fork server (NOTE [fork server] there)."""
        if self.server is None:
            self.server = subprocess.Popen([self.python, REFERENCE, "serve"], env=self.env,
                                           cwd=self.work, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True)
        start = time.time()
        self.server.stdin.write(json.dumps({"argv": list(args)}) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        if not line:
            raise Failure(f"hf_reference.py serve died (exit {self.server.wait()}) running "
                          f"{' '.join(args)}")
        reply = json.loads(line)
        proc = subprocess.CompletedProcess([REFERENCE, *args], reply["rc"], reply["stdout"],
                                           reply["stderr"])
        self.report(proc, time.time() - start, expect_rc, what)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                print("    " + line, flush=True)
        return proc

    def tool(self, name, *args, expect_rc=0, what=""):
        binary = os.path.join(self.bin, name)
        if not os.access(binary, os.X_OK):
            raise Failure(f"{binary} is missing: build it (cmake --build build --target {name})")
        return self.run([binary, *args], expect_rc=expect_rc, what=what)


def check_case(r, name, tokens):
    make_args, controls = CASES[name]
    hf = r.path(name + ".hf")
    ckpt = r.path(name + ".ckpt")
    exported = r.path(name + ".export")
    ours = r.path(name + ".fulcrum.safetensors")
    theirs = r.path(name + ".reference.safetensors")
    r.reference("make", *make_args, "--out", hf)
    r.tool("fulcrum_ckpt", "import-hf", hf, ckpt)
    r.tool("fulcrum_hf_logits", f"--load={ckpt}", f"--tokens={tokens}", f"--out={ours}", *ADAM,
           what=f"{name}: fulcrum_hf_logits on the imported checkpoint")
    # The references of the model and of its negative controls, in one process.
    models = ["--model", hf, "--out", theirs]
    for kind in controls:
        r.reference("perturb", "--model", hf, "--out", r.path(f"{name}.{kind}.hf"), "--kind", kind)
        models += ["--model", r.path(f"{name}.{kind}.hf"),
                   "--out", r.path(f"{name}.{kind}.safetensors")]
    r.reference("reference", "--tokens", tokens, *models, *ADAM)
    r.reference("compare", "--actual", ours, "--expect", theirs,
                what=f"{name}: Fulcrum against transformers")
    for kind in controls:
        r.reference("compare", "--actual", r.path(f"{name}.{kind}.safetensors"), "--expect", ours,
                    "--expect_fail", what=f"{name}: negative control {kind}")
    r.tool("fulcrum_ckpt", "export-hf", ckpt, exported)
    r.reference("check-export", "--model", exported, "--tokens", tokens, "--expect", ours,
                what=f"{name}: export-hf loaded by transformers")
    if name == "llama":
        # check-export's own negative control: an export missing a tensor must fail it.
        broken = r.path(f"{name}.export.drop_norm")
        r.reference("perturb", "--model", exported, "--out", broken, "--kind", "drop_norm")
        proc = r.reference("check-export", "--model", broken, "--tokens", tokens, "--expect", ours,
                           expect_rc=1, what=f"{name}: check-export of an export without a tensor")
        if "model.norm.weight" not in proc.stderr:
            raise Failure(f"check-export of {broken} failed without naming model.norm.weight:\n"
                          f"{proc.stderr}")


def import_printing_flags(r, hf, ckpt):
    """import-hf of `hf` into `ckpt`; the model flags of the fulcrum_train line it prints."""
    printed = r.tool("fulcrum_ckpt", "import-hf", hf, ckpt).stdout
    marker = " --finetune "
    line = next((l for l in printed.splitlines() if marker in l), None)
    if line is None:
        raise Failure(f"import-hf printed no fulcrum_train flags:\n{printed}")
    return line.split(marker, 1)[1].split()


def check_tuned_export(r, name, tuned, hf, tokens, what):
    """Fulcrum's logits of the fine-tuned checkpoint `tuned`; its export-hf, loaded by
    transformers, gives them; and they are far from transformers' logits of the imported `hf`
    (it trained). Returns the export's directory."""
    ours = r.path(f"{name}.fulcrum.safetensors")
    r.tool("fulcrum_hf_logits", f"--load={tuned}", f"--tokens={tokens}", f"--out={ours}", *ADAM,
           what=f"fulcrum_hf_logits on {what}")
    exported = r.path(f"{name}.export")
    r.tool("fulcrum_ckpt", "export-hf", tuned, exported)
    r.reference("check-export", "--model", exported, "--tokens", tokens, "--expect", ours,
                what=f"{what}, exported and loaded by transformers")
    before = r.path(f"{name}.imported.safetensors")
    r.reference("reference", "--tokens", tokens, "--model", hf, "--out", before, *ADAM)
    r.reference("compare", "--actual", before, "--expect", ours, "--expect_fail",
                what=f"{what} against the imported one")
    return exported


def check_trained(r, tokens):
    """Import → fine-tune 10 iterations at pp=2 with layers migrating → 5 more at tp=2 →
    export: transformers loads the result and reproduces Fulcrum's logits of it."""
    hf = r.path("trained.hf")
    ckpt = r.path("trained.imported")
    r.reference("make", "--arch", "llama", "--layers", "4", "--out", hf)
    model_flags = import_printing_flags(r, hf, ckpt)
    launch = [os.path.join(r.bin, "fulcrum_launch"), "--nproc_per_node=2", "--master_port=0", "--",
              os.path.join(r.bin, "fulcrum_train")]
    common = model_flags + ["--seq_length=32", "--micro_batch_size=2", "--global_batch_size=8",
                            "--lr=1e-3", "--lr_warmup_iters=2", "--eval_interval=0",
                            "--log_interval=5", "--train_iters=15"]
    # [0,2)|[2,4) → (3) [0,1)|[1,4) → (6) [0,3)|[3,4): two plans, three layer moves.
    pp_ckpt, pp_metrics = r.path("trained.pp2"), r.path("trained.pp2.jsonl")
    r.run(launch + [f"--load={ckpt}", "--finetune", *common, "--exit_interval=10",
                    "--pipeline_model_parallel_size=2", "--pipeline_schedule=zbh1",
                    "--rebalance_script=3:1->1;6:1->0,2->0", f"--save={pp_ckpt}",
                    f"--metrics_file={pp_metrics}"],
          what="fine-tuning the import at pp=2 with layers moving")
    with open(pp_metrics) as f:
        records = [json.loads(l) for l in f if l.strip()]
    moved = [rec.get("layers_moved", 0) for rec in records]
    if len(records) != 10 or moved[-1] != 3:
        raise Failure(f"the pp=2 fine-tune should log 10 iterations and 3 layer moves, got "
                      f"{len(records)} iterations, layers_moved {moved}")
    tp_ckpt = r.path("trained.tp2")
    r.run(launch + [f"--load={pp_ckpt}", *common, "--tensor_model_parallel_size=2",
                    f"--save={tp_ckpt}"],
          what="resuming it at tp=2")
    check_tuned_export(r, "trained", tp_ckpt, hf, tokens, "the fine-tuned model")


def check_gpt2_shorter(r, tokens):
    """GPT-2 (n_positions 64) fine-tuned at 32 tokens on its whole position table: the flags
    import-hf prints keep the table (--max_position_embeddings=64), the run trains, and the
    export still has 64 positions, loaded by transformers with Fulcrum's logits. Without
    --max_position_embeddings the run would build a 32-row table: refused, naming the flag."""
    hf = r.path("gpt2_shorter.hf")
    ckpt = r.path("gpt2_shorter.imported")
    r.reference("make", "--arch", "gpt2", "--seq", "64", "--out", hf)
    model_flags = import_printing_flags(r, hf, ckpt)
    if "--max_position_embeddings=64" not in model_flags:
        raise Failure(f"import-hf's GPT-2 flags do not keep the 64-row table: {model_flags}")
    train = os.path.join(r.bin, "fulcrum_train")
    common = ["--seq_length=32", "--micro_batch_size=2", "--global_batch_size=4", "--lr=1e-3",
              "--eval_interval=0", "--log_interval=5", "--train_iters=5"]
    without = [f for f in model_flags if not f.startswith("--max_position_embeddings")]
    proc = r.run([train, f"--load={ckpt}", "--finetune", *without, *common],
                 expect_rc=2, what="fine-tuning GPT-2 at 32 tokens without --max_position_embeddings")
    if "--max_position_embeddings=64" not in proc.stderr + proc.stdout:
        raise Failure("the refusal does not say which --max_position_embeddings keeps the "
                      f"table:\n{proc.stderr}")
    tuned = r.path("gpt2_shorter.tuned")
    r.run([train, f"--load={ckpt}", "--finetune", *model_flags, *common, f"--save={tuned}"],
          what="fine-tuning GPT-2 at 32 tokens on its 64-row table")
    exported = check_tuned_export(r, "gpt2_shorter", tuned, hf, tokens,
                                  "the GPT-2 fine-tuned at 32 tokens")
    with open(os.path.join(exported, "config.json")) as f:
        n_positions = json.load(f).get("n_positions")
    if n_positions != 64:
        raise Failure(f"the fine-tuned GPT-2 exported with n_positions={n_positions}, not 64")


def edit_config(hf, **changes):
    path = os.path.join(hf, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def check_refused(r, hf, what, message):
    """import-hf of `hf` exits 2 naming `message`, and leaves nothing behind."""
    out = r.path(os.path.basename(hf) + ".ckpt")
    before = set(os.listdir(r.work))
    proc = r.tool("fulcrum_ckpt", "import-hf", hf, out, expect_rc=2, what=f"import-hf of {what}")
    if message not in proc.stderr + proc.stdout:
        raise Failure(f"import-hf of {what}: the message does not name {message!r}:\n"
                      f"{proc.stderr}")
    left = set(os.listdir(r.work)) - before
    if os.path.exists(out) or left:
        raise Failure(f"import-hf of {what} exited 2 but wrote {sorted(left) or out}")
    said = (proc.stderr.strip().splitlines() or [""])[-1]
    print(f"    refused, naming {message!r}, nothing written: {said}", flush=True)


def check_bad_inputs(r):
    base = r.path("bad.llama.hf")
    r.reference("make", "--arch", "llama", "--shards", "3", "--layers", "1", "--out", base)
    # A shard the index names is missing.
    hf = r.path("bad.missing_shard.hf")
    shutil.copytree(base, hf)
    victim = sorted(glob.glob(os.path.join(hf, "model-*.safetensors")))[1]
    os.remove(victim)
    check_refused(r, hf, "a missing shard", os.path.basename(victim))
    # A tensor whose shape does not match the config.
    hf = r.path("bad.shape.hf")
    shutil.copytree(base, hf)
    edit_config(hf, intermediate_size=160)
    check_refused(r, hf, "a shape mismatch", "has shape")
    # An architecture Fulcrum does not have.
    hf = r.path("bad.arch.hf")
    shutil.copytree(base, hf)
    edit_config(hf, architectures=["FalconForCausalLM"], model_type="falcon")
    check_refused(r, hf, "an unknown architecture", "Falcon")
    # A sliding window (Mixtral's config field), which Fulcrum's attention does not have.
    hf = r.path("bad.window.hf")
    r.reference("make", "--arch", "mixtral", "--layers", "1", "--out", hf)
    edit_config(hf, sliding_window=16)
    check_refused(r, hf, "sliding_window set", "sliding_window")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", required=True, help="build directory (binaries in bin/)")
    parser.add_argument("--python", default=sys.executable,
                        help="the venv's python, with torch and transformers")
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--skip_bad_inputs", action="store_true")
    parser.add_argument("--keep", default="", help="work here and keep the files")
    args = parser.parse_args()

    check = subprocess.run([args.python, "-c", "import transformers, torch, safetensors; "
                            "print(transformers.__version__)"], capture_output=True, text=True)
    if check.returncode != 0:
        print(f"FAIL: {args.python} cannot import transformers (tools/setup.sh installs it):\n"
              f"{check.stderr}", file=sys.stderr)
        return 1
    print(f"transformers {check.stdout.strip()} on {args.python}", flush=True)

    for name in ("fulcrum_ckpt", "fulcrum_hf_logits"):
        binary = os.path.join(args.build, "bin", name)
        if not os.access(binary, os.X_OK):
            print(f"FAIL: {binary} is missing: build it (cmake --build build --target {name})",
                  file=sys.stderr)
            return 1

    work = args.keep or tempfile.mkdtemp(prefix="fulcrum_hf_interop_")
    os.makedirs(work, exist_ok=True)
    r = Runner(args, work)
    failures = []
    try:
        tokens = r.path("tokens.json")
        # Ids below 257: the byte tokenizer's, inside every model's padded vocabulary.
        r.reference("tokens", "--vocab", "257", "--batch", "2", "--seq", "32", "--out", tokens)
        for name in [c for c in args.cases.split(",") if c]:
            if name not in CASES:
                failures.append(f"unknown case {name}")
                continue
            print(f"== {name}", flush=True)
            try:
                check_case(r, name, tokens)
            except Failure as e:
                failures.append(str(e))
        print("== trained: import, fine-tune at pp=2 (moving layers) and tp=2, export", flush=True)
        try:
            check_trained(r, tokens)
        except Failure as e:
            failures.append(str(e))
        print("== gpt2 fine-tuned at 32 of its 64 positions, export", flush=True)
        try:
            check_gpt2_shorter(r, tokens)
        except Failure as e:
            failures.append(str(e))
        if not args.skip_bad_inputs:
            print("== bad inputs", flush=True)
            try:
                check_bad_inputs(r)
            except Failure as e:
                failures.append(str(e))
    finally:
        r.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    print("PASS" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
