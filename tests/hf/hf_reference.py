#!/usr/bin/env python3
"""The Hugging Face side of Fulcrum's interoperability proof (tests/hf/hf_interop_test.py).

Runs on the python of the venv that tools/setup.sh makes (torch, transformers pinned there).
Everything here is offline: models are made from configs, never downloaded.

  make        --arch gpt2|llama|mixtral --out DIR [--shards N] [shape options]
              a tiny seeded model made by transformers, saved with save_pretrained
              (safetensors; --shards N > 1 writes model-XXXXX-of-YYYYY.safetensors and
              model.safetensors.index.json)
  tokens      --vocab V --batch B --seq S --seed K --out FILE
              B rows of S+1 token ids as JSON {"tokens": [[...], ...]}
  reference   --model DIR --tokens FILE --out FILE [--model DIR --out FILE ...] [AdamW flags]
              logits, mean loss, and the loss after one torch.optim.AdamW step
  check-export --model DIR --tokens FILE --expect FILE
              from_pretrained with no warning at all (missing, unexpected or mismatched
              keys are warnings), and its logits within the tolerance of --expect's
  compare     --actual FILE --expect FILE [--tolerance T] [--expect_fail]
              the relative differences of two result files; exit 1 past the tolerance
  perturb     --model DIR --out DIR --kind KIND
              a copy of a model with one deliberate conversion mistake, for the negative
              controls (the tolerance must catch each)
  serve       (no options) the commands above, one per request, each in a process forked
              from this one after torch and transformers were imported (NOTE [fork server])

NOTE [fork server]
Importing torch and transformers costs a new python ~5 s of CPU, and the interop test runs
about fifty commands: that import was most of its time. `serve` imports them once, then
reads one JSON request a line from stdin, {"argv": [...]}, forks, and runs the command in
the child as `hf_reference.py ARGV...` would run it: a child starts from the state of a
fresh import (the parent runs nothing else, so no cache, seed or `warning_once` memory of an
earlier command reaches it), its file descriptors 1 and 2 go to files (so the loggers'
handlers that hold sys.stderr are captured too), and its exit code is its own. The reply is
one JSON line on the server's stdout: {"rc": N, "stdout": "...", "stderr": "..."}. EOF on
stdin ends the server.

NOTE [hf comparison file]
`reference` and build/bin/fulcrum_hf_logits (tests/hf/hf_logits_main.cc) write the same
safetensors file, so one `compare` reads either:
  logits           F32 [b, s, V]  of the inputs (the first s of each row's s+1 tokens)
  loss             F64 []         mean cross-entropy of the labels (the last s tokens)
  loss_after_step  F64 []         the same after one AdamW step on that loss (no clipping;
                                  decoupled weight decay on tensors of ≥ 2 dimensions only,
                                  as Fulcrum, which decays no bias or norm weight)
Relative difference: max|a − b| / max|b| over the logits (an element-wise ratio is
meaningless near zero), |a − b| / |b| for the losses. Tolerance 1e-5.

NOTE [transformers save format] (transformers 5.24.0, torch 2.11.0, checked by hand with
`make` and safetensors.safe_open; the test relies on what `make` writes, not on this note)
- GPT2LMHeadModel: keys transformer.wte/wpe/h.<i>.{ln_1,attn.c_attn,attn.c_proj,ln_2,
  mlp.c_fc,mlp.c_proj}/ln_f; Conv1D weights stored [in, out] (c_attn [h, 3h], columns
  q|k|v each all heads); no lm_head.weight key (tied, tie_word_embeddings: true). config
  "activation_function" defaults to "gelu_new"; bos/eos default to 50256 (a warning when the
  vocabulary is smaller, so `make` sets them to None).
- LlamaForCausalLM: model.embed_tokens, model.layers.<i>.{input_layernorm,
  self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm,
  lm_head.weight (absent when tied). config.json has NO top-level "rope_theta": v5 writes
  "rope_parameters": {"rope_theta": θ, "rope_type": "default"}; from_pretrained still reads
  a legacy top-level "rope_theta" (hub checkpoints) into rope_parameters. Default
  rms_norm_eps 1e-6, head_dim written explicitly.
- MixtralForCausalLM: in memory v5 FUSES the experts (model.layers.<i>.mlp.experts.
  gate_up_proj [E, 2F, h] = per expert [w1 (gate) rows; w3 (up) rows] concatenated, not
  interleaved; mlp.experts.down_proj [E, h, F]; router mlp.gate.weight [E, h]), but
  save_pretrained converts back (conversion_mapping.py, "mixtral") and WRITES THE HUB
  LAYOUT: model.layers.<i>.block_sparse_moe.gate.weight [E, h] and
  block_sparse_moe.experts.<j>.{w1,w3}.weight [F, h], w2.weight [h, F]. from_pretrained
  accepts both the per-expert hub layout and the fused in-memory names (checked: identical
  tensors, no missing/unexpected keys). config: rope_parameters as Llama (default θ 1e6),
  sliding_window null by default, router_jitter_noise 0, tie_word_embeddings false.
- Loading reports missing/unexpected/mismatched keys as a "LOAD REPORT" warning on the
  "transformers" logger and in output_loading_info; `check-export` fails on either.
"""

import argparse
import json
import logging
import math
import os
import shutil
import sys
import warnings

TOLERANCE = 1e-5


def _fail(message):
    print(f"hf_reference: {message}", file=sys.stderr)
    sys.exit(1)


def _imports():
    """torch and transformers, or a failure (never a skip: tools/setup.sh installs both)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError as e:
        _fail(f"{e}: run tools/setup.sh, which installs torch and transformers into the venv "
              f"({sys.executable})")
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


# ---------------------------------------------------------------------------------------
# make


def _config(args):
    import transformers
    common = dict(vocab_size=args.vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  initializer_range=args.init_std)
    if args.arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, n_positions=args.seq,
            n_inner=args.ffn, activation_function=args.activation or "gelu_new",
            layer_norm_epsilon=args.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=True, **common)
    llama_like = dict(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        hidden_act=args.activation or "silu", attention_dropout=0.0,
        tie_word_embeddings=args.tie, **common)
    if args.arch == "llama":
        return transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **llama_like)
    if args.arch == "mixtral":
        return transformers.MixtralConfig(
            num_local_experts=args.experts, num_experts_per_tok=args.top_k, sliding_window=None,
            router_jitter_noise=0.0, router_aux_loss_coef=args.aux_loss_coef, **llama_like)
    _fail(f"--arch={args.arch}: expected gpt2, llama or mixtral")


def _randomise(model, seed, std):
    """Every parameter random and distinct, so a mix-up of any two tensors (ln_1 and ln_2,
    a bias and a norm) changes the logits: norms 1 + N(0, 0.1²), biases N(0, 0.1²), weights
    N(0, std²). transformers' own init sets norms to 1 and biases to 0."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() >= 2:
                p.copy_(noise * std)
            elif "norm" in name or ".ln_" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def cmd_make(args):
    _imports()
    import torch
    import transformers
    torch.manual_seed(args.seed)
    defaults = {"gpt2": (64, 256, 4, 4), "llama": (64, 176, 4, 2), "mixtral": (64, 96, 4, 2)}
    hidden, ffn, heads, kv = defaults[args.arch]
    args.hidden = args.hidden or hidden
    args.ffn = args.ffn or ffn
    args.heads = args.heads or heads
    args.kv_heads = args.kv_heads or (heads if args.arch == "gpt2" else kv)
    config = _config(args)
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
           "mixtral": transformers.MixtralForCausalLM}[args.arch]
    model = cls(config).to(torch.float32)
    _randomise(model, args.seed, args.init_std)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # One file unless --shards: then at most total/N bytes a file (a tensor larger than that
    # gets its own file), which gives at least N files.
    shard = max(1, total // args.shards) if args.shards > 1 else total * 2
    if args.fused_experts:
        # The names transformers 5 uses in memory (mlp.experts.gate_up_proj [E, 2F, h],
        # mlp.experts.down_proj, mlp.gate), which save_pretrained converts back to the hub's
        # per-expert layout; from_pretrained reads both (NOTE [transformers save format]).
        from safetensors.torch import save_file
        if args.arch != "mixtral" or args.shards > 1:
            _fail("--fused_experts is for --arch=mixtral, unsharded")
        os.makedirs(args.out, exist_ok=True)
        config.save_pretrained(args.out)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(args.out, safe_serialization=True, max_shard_size=shard)
    if args.v4_config:
        # config.json as transformers 4 wrote it, as most hub checkpoints hold it: a
        # top-level rope_theta, torch_dtype. transformers 5 reads it into rope_parameters.
        path = os.path.join(args.out, "config.json")
        with open(path) as f:
            written = json.load(f)
        rope = written.pop("rope_parameters", None) or {}
        if "rope_theta" in rope:
            written["rope_theta"] = rope["rope_theta"]
        written["torch_dtype"] = written.pop("dtype", "float32")
        written["transformers_version"] = "4.46.0"
        with open(path, "w") as f:
            json.dump(written, f, indent=2)
    files = sorted(f for f in os.listdir(args.out) if f.endswith(".safetensors"))
    if args.shards > 1 and (len(files) < 2 or
                            not os.path.exists(os.path.join(args.out, "model.safetensors.index.json"))):
        _fail(f"--shards={args.shards}: save_pretrained wrote {files} without an index")
    print(json.dumps({"arch": args.arch, "out": args.out, "files": files, "bytes": total,
                      "transformers": transformers.__version__}))


# ---------------------------------------------------------------------------------------
# tokens


def cmd_tokens(args):
    import random
    rng = random.Random(args.seed)
    rows = [[rng.randrange(args.vocab) for _ in range(args.seq + 1)] for _ in range(args.batch)]
    with open(args.out, "w") as f:
        json.dump({"tokens": rows}, f)


def _read_tokens(path):
    import torch
    with open(path) as f:
        rows = json.load(f)["tokens"]
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------------------------------
# reference / check-export


class _Captured(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


def _load(model_dir, strict):
    """from_pretrained on `model_dir` in fp32 on the CPU. With `strict`, any warning (the
    LOAD REPORT of missing/unexpected/mismatched keys among them) or a non-empty loading
    info fails, printing them."""
    import torch
    import transformers
    captured = _Captured()
    tf_logger = logging.getLogger("transformers")
    tf_logger.addHandler(captured)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager",
            output_loading_info=True, local_files_only=True)
    tf_logger.removeHandler(captured)
    problems = [f"{key}: {sorted(value)}" for key, value in info.items() if value]
    if strict:
        # Python warnings raised by the loading code (not, say, a DeprecationWarning of an
        # unrelated library that imports inside it).
        ours = ("transformers", "huggingface_hub", "safetensors")
        problems += captured.messages + [f"warning: {w.message} ({w.filename})" for w in caught
                                         if any(part in w.filename for part in ours)]
    if problems:
        _fail(f"from_pretrained({model_dir}) was not clean:\n  " + "\n  ".join(problems))
    model.eval()  # No dropout, whatever the config says (the comparison has none).
    return model


def _logits_and_loss(model, tokens):
    import torch
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits = model(input_ids=inputs, use_cache=False).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             labels.reshape(-1))
    return logits, loss


def _reference(model_dir, tokens, args):
    import torch
    from safetensors.torch import save_file
    model = _load(model_dir, strict=True)
    with torch.no_grad():
        logits, loss = _logits_and_loss(model, tokens)
    # One AdamW step as Fulcrum's (core/optimizer/adamw.h): decoupled decay, none on biases and
    # norm weights (the 1-D tensors), no clipping. A tied weight is one parameter here and
    # one in Fulcrum.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_eps, foreach=False)
    _, step_loss = _logits_and_loss(model, tokens)
    step_loss.backward()
    optimizer.step()
    with torch.no_grad():
        _, loss_after = _logits_and_loss(model, tokens)
    return logits, loss, loss_after


def cmd_reference(args):
    _imports()
    from safetensors.torch import save_file
    if len(args.model) != len(args.out):
        _fail(f"{len(args.model)} --model but {len(args.out)} --out: give them in pairs")
    tokens = _read_tokens(args.tokens)
    # Several models in one process: importing transformers costs seconds each time.
    for model_dir, out in zip(args.model, args.out):
        logits, loss, loss_after = _reference(model_dir, tokens, args)
        save_file({"logits": logits.contiguous(),
                   "loss": loss.double().reshape(()),
                   "loss_after_step": loss_after.double().reshape(())},
                  out, metadata={"producer": "hf_reference.py", "model": model_dir})
        print(json.dumps({"model": model_dir, "loss": loss.item(),
                          "loss_after_step": loss_after.item()}))


def _differences(actual, expect):
    """Relative differences as NOTE [hf comparison file] defines them."""
    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
    if actual["logits"].shape != expect["logits"].shape:
        _fail(f"logits shapes differ: {list(actual['logits'].shape)} vs "
              f"{list(expect['logits'].shape)}")
    out = {"logits": rel(actual["logits"], expect["logits"])}
    for key in ("loss", "loss_after_step"):
        if key in actual and key in expect:
            out[key] = rel(actual[key], expect[key])
    return out


def cmd_check_export(args):
    _imports()
    import torch
    from safetensors.torch import load_file
    model = _load(args.model, strict=True)
    tokens = _read_tokens(args.tokens)
    with torch.no_grad():
        logits, loss = _logits_and_loss(model, tokens)
    diffs = _differences({"logits": logits, "loss": loss}, load_file(args.expect))
    print(json.dumps({"model": args.model, "relative_difference": diffs}))
    worst = max(diffs.values())
    if not worst <= args.tolerance:
        _fail(f"{args.model}: relative difference {worst:.3g} exceeds {args.tolerance:g}")


def cmd_compare(args):
    # torch and safetensors only: importing transformers costs seconds.
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        _fail(f"{e}: run tools/setup.sh")
    diffs = _differences(load_file(args.actual), load_file(args.expect))
    worst = max(diffs.values())
    within = worst <= args.tolerance  # False for NaN too.
    print(json.dumps({"actual": args.actual, "expect": args.expect, "relative_difference": diffs,
                      "tolerance": args.tolerance, "within": within}))
    if args.expect_fail:
        # A negative control: the deliberate mistake must show, and clearly (10× the
        # tolerance), or the tolerance has no teeth for it. Measured (tests/hf defaults):
        # gelu read as gelu_new 1.2e-4, a wrong rope base 4e-2, rotary rows permuted 0.14,
        # gate and up swapped 0.24–0.38, Conv1D not transposed 0.64.
        if within or not worst > 10 * args.tolerance:
            _fail(f"negative control {args.actual}: relative difference {worst:.3g} is not "
                  f"above 10 × {args.tolerance:g}")
    elif not within:
        _fail(f"{args.actual} vs {args.expect}: relative difference {worst:.3g} exceeds "
              f"{args.tolerance:g}")


# ---------------------------------------------------------------------------------------
# perturb: negative controls


def _permute_rotary_rows(w, heads):
    """The Meta→HF rotary permutation (transformers' convert_llama_weights_to_hf.py
    `permute`): pairs (2i, 2i+1) become (i, i + d/2). Applying it to HF weights is the
    mistake of a converter that pairs the wrong dimensions."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def cmd_perturb(args):
    # Files only: no transformers import (seconds).
    from safetensors.torch import load_file, save_file
    shutil.copytree(args.model, args.out)
    with open(os.path.join(args.out, "config.json")) as f:
        config = json.load(f)
    changed = []
    if args.kind == "rope_base":
        # A converter that ignores rope_parameters (v5) and uses the default base.
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta"))
        wrong = 10000.0 if theta != 10000.0 else 500000.0
        config["rope_parameters"] = dict(rope, rope_theta=wrong)
        config.pop("rope_theta", None)
        changed.append(f"rope_theta {theta} -> {wrong}")
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    elif args.kind == "activation":
        # A converter that reads gelu_new as the exact GeLU (or the reverse).
        act = config.get("activation_function")
        wrong = "gelu" if act == "gelu_new" else "gelu_new"
        config["activation_function"] = wrong
        changed.append(f"activation_function {act} -> {wrong}")
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    else:
        for name in sorted(os.listdir(args.out)):
            if not name.endswith(".safetensors"):
                continue
            path = os.path.join(args.out, name)
            tensors = load_file(path)
            for key in list(tensors):
                if args.kind == "conv1d_transpose" and key.endswith("attn.c_proj.weight"):
                    # GPT-2's Conv1D stores [in, out]; a converter that forgets to transpose
                    # (c_proj is square, so the shapes still fit).
                    tensors[key] = tensors[key].t().contiguous()
                    changed.append(key)
                elif args.kind == "qk_permute" and (key.endswith("q_proj.weight") or
                                                    key.endswith("k_proj.weight")):
                    heads = (config["num_attention_heads"] if "q_proj" in key
                             else config["num_key_value_heads"])
                    tensors[key] = _permute_rotary_rows(tensors[key], heads).contiguous()
                    changed.append(key)
                elif args.kind == "drop_norm" and key.endswith("model.norm.weight"):
                    # An exporter that forgets a tensor: from_pretrained must complain.
                    del tensors[key]
                    changed.append(key)
                elif args.kind == "gate_up_swap" and (".w1." in key or "gate_proj" in key):
                    other = key.replace(".w1.", ".w3.").replace("gate_proj", "up_proj")
                    tensors[key], tensors[other] = tensors[other], tensors[key]
                    changed.append(key)
            save_file(tensors, path, metadata={"format": "pt"})
    if not changed:
        _fail(f"--kind={args.kind} changed nothing in {args.model}")
    print(json.dumps({"kind": args.kind, "out": args.out, "changed": changed}))


# ---------------------------------------------------------------------------------------


def cmd_serve(args):
    import tempfile
    _imports()
    # What the commands import lazily, imported once here (transformers loads a model's
    # module on first use).
    import safetensors.torch  # noqa: F401
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401
    replies = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        if not line.strip():
            continue
        argv = json.loads(line)["argv"]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.dup2(out.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                    main(argv)
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if not isinstance(e.code, (int, type(None))):
                        print(e.code, file=sys.stderr)
                except BaseException:  # noqa: B036: the child reports whatever stopped it
                    import traceback
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            rc = os.waitstatus_to_exitcode(status)
            out.seek(0)
            err.seek(0)
            reply = {"rc": rc, "stdout": out.read().decode("utf-8", "replace"),
                     "stderr": err.read().decode("utf-8", "replace")}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make", help="a tiny seeded transformers model, save_pretrained")
    make.add_argument("--arch", required=True, choices=["gpt2", "llama", "mixtral"])
    make.add_argument("--out", required=True)
    make.add_argument("--shards", type=int, default=1)
    make.add_argument("--seed", type=int, default=1234)
    # 384: the embedded corpus's byte tokenizer has 257 ids (256 bytes + end of document),
    # which fulcrum_train pads to a multiple of --make_vocab_size_divisible_by=128.
    make.add_argument("--vocab", type=int, default=384)
    make.add_argument("--layers", type=int, default=2)
    make.add_argument("--hidden", type=int, default=0)
    make.add_argument("--ffn", type=int, default=0)
    make.add_argument("--heads", type=int, default=0)
    make.add_argument("--kv_heads", type=int, default=0)
    make.add_argument("--seq", type=int, default=64, help="max positions")
    make.add_argument("--activation", default="", help="gpt2: gelu_new (default) or gelu")
    make.add_argument("--norm_eps", type=float, default=1e-5)
    make.add_argument("--rope_theta", type=float, default=10000.0)
    make.add_argument("--tie", action="store_true", help="llama/mixtral: tied embeddings")
    make.add_argument("--experts", type=int, default=4)
    make.add_argument("--top_k", type=int, default=2)
    make.add_argument("--aux_loss_coef", type=float, default=0.0)
    make.add_argument("--init_std", type=float, default=0.05)
    make.add_argument("--v4_config", action="store_true",
                      help="rewrite config.json as transformers 4 wrote it (top-level rope_theta)")
    make.add_argument("--fused_experts", action="store_true",
                      help="mixtral: write transformers 5's fused expert tensors")
    make.set_defaults(func=cmd_make)

    tokens = sub.add_parser("tokens", help="random token rows as JSON")
    tokens.add_argument("--vocab", type=int, default=257)
    tokens.add_argument("--batch", type=int, default=2)
    tokens.add_argument("--seq", type=int, default=32)
    tokens.add_argument("--seed", type=int, default=0)
    tokens.add_argument("--out", required=True)
    tokens.set_defaults(func=cmd_tokens)

    ref = sub.add_parser("reference", help="logits, loss, loss after one AdamW step")
    ref.add_argument("--model", required=True, action="append", help="repeatable")
    ref.add_argument("--tokens", required=True)
    ref.add_argument("--out", required=True, action="append", help="one per --model")
    ref.add_argument("--lr", type=float, default=1e-3)
    ref.add_argument("--weight_decay", type=float, default=0.0)
    ref.add_argument("--adam_beta1", type=float, default=0.9)
    ref.add_argument("--adam_beta2", type=float, default=0.999)
    ref.add_argument("--adam_eps", type=float, default=1e-8)
    ref.set_defaults(func=cmd_reference)

    check = sub.add_parser("check-export", help="from_pretrained clean, logits as expected")
    check.add_argument("--model", required=True)
    check.add_argument("--tokens", required=True)
    check.add_argument("--expect", required=True)
    check.add_argument("--tolerance", type=float, default=TOLERANCE)
    check.set_defaults(func=cmd_check_export)

    compare = sub.add_parser("compare", help="relative differences of two result files")
    compare.add_argument("--actual", required=True)
    compare.add_argument("--expect", required=True)
    compare.add_argument("--tolerance", type=float, default=TOLERANCE)
    compare.add_argument("--expect_fail", action="store_true")
    compare.set_defaults(func=cmd_compare)

    perturb = sub.add_parser("perturb", help="a copy with one deliberate conversion mistake")
    perturb.add_argument("--model", required=True)
    perturb.add_argument("--out", required=True)
    perturb.add_argument("--kind", required=True,
                         choices=["rope_base", "conv1d_transpose", "qk_permute", "gate_up_swap",
                                  "activation", "drop_norm"])
    perturb.set_defaults(func=cmd_perturb)

    serve = sub.add_parser("serve", help="run commands from stdin in forked children")
    serve.set_defaults(func=cmd_serve)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
