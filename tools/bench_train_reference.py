#!/usr/bin/env python3
"""The PyTorch twin of fulcrum_bench_train's GPT step (--compare_reference), eager or compiled.

A pre-LayerNorm GPT written the ordinary PyTorch way (nn.Linear with biases, learned
positions, causal scaled_dot_product_attention, GeLU MLP, untied or tied output layer,
mean cross-entropy), trained with torch.optim.AdamW and clip_grad_norm_ over gradient
accumulation, the same shape and thread count as the Fulcrum side. With --compile the model is wrapped
in torch.compile (inductor; on the CPU it generates C++ and builds it with the machine's
g++); compiling happens during the warm-up steps and is not timed.

It is driven over a pipe so the C++ benchmark can interleave the two round by round: each
line "N" on stdin runs N training steps and answers one line with their wall seconds; "q"
(or end of input) exits. It prints "ready" once the model is built and warmed up.
"""
import argparse
import math
import os
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--ffn", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--micro_batch", type=int, required=True)
    p.add_argument("--global_batch", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="0 keeps PyTorch's default")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--bf16", action="store_true",
                   help="mixed precision: fp32 weights and optimizer, bf16 compute (autocast)")
    p.add_argument("--attention", choices=("sdpa", "explicit"), default="sdpa",
                   help="sdpa: F.scaled_dot_product_attention(is_causal=True), as Fulcrum's "
                        "core computes it and as a PyTorch user writes it today; explicit: "
                        "the softmax of the masked score matrix (what this script did before "
                        "2026-11-26: its [b, heads, s, s] scores cost the GPU sides dearly)")
    p.add_argument("--trace", default="",
                   help="after warmup, write a chrome trace of 3 steps here and exit "
                        "(tools/op_profile_summary.py sums it by op)")
    args = p.parse_args()

    import warnings
    # torch's import warns when numpy is absent; the reference does not use numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            h = args.hidden
            self.ln1 = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, 3 * h)
            self.proj = nn.Linear(h, h)
            self.ln2 = nn.LayerNorm(h)
            self.fc1 = nn.Linear(h, args.ffn)
            self.fc2 = nn.Linear(args.ffn, h)

        def forward(self, x, mask):  # x: [b, s, h]
            b, s, h = x.shape
            d = h // args.heads
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, args.heads, d).permute(2, 0, 3, 1, 4)
            if args.attention == "sdpa":  # flash / memory-efficient kernels where they exist
                context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
                probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
                context = probs @ v
            context = context.transpose(1, 2).reshape(b, s, h)
            x = x + self.proj(context)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(args.vocab, args.hidden)
            self.wpe = nn.Embedding(args.seq, args.hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.lnf = nn.LayerNorm(args.hidden)
            self.head = nn.Linear(args.hidden, args.vocab, bias=False) if args.untied else None
            self.register_buffer("mask", torch.ones(args.seq, args.seq, dtype=torch.bool).triu(1))

        def forward(self, tokens):  # [b, s+1] → mean loss
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            x = self.wte(inputs) + self.wpe.weight[: inputs.shape[1]]
            for block in self.blocks:
                x = block(x, self.mask)
            x = self.lnf(x)
            logits = self.head(x) if self.head is not None else x @ self.wte.weight.t()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    device = torch.device(args.device)
    model = Gpt().to(device)
    compiled = torch.compile(model) if args.compile else model

    def run(tokens):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            return compiled(tokens)

    def synchronize():  # Wall time on a GPU counts work, not launches.
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    decay = [q for n, q in model.named_parameters() if q.dim() >= 2]
    no_decay = [q for n, q in model.named_parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-4)
    micro = args.global_batch // args.micro_batch
    batches = torch.randint(args.vocab, (micro, args.micro_batch, args.seq + 1), device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            (run(batches[m]) / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(args.warmup):
        step()
    synchronize()
    if args.trace:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":  # the kernels' own times (op_profile_summary.py --kernels)
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):
                step()
            synchronize()
        prof.export_chrome_trace(args.trace)
        return
    print("ready threads=%d" % torch.get_num_threads(), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line or line == "q":
            break
        n = int(line)
        start = time.perf_counter()
        for _ in range(n):
            step()
        synchronize()
        print("%.6f" % (time.perf_counter() - start), flush=True)


if __name__ == "__main__":
    main()
