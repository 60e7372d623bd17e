"""Can this machine train tiny models on multi-query associative recall (MQAR)? Measured, not assumed.

Chapter 12 asks whether a 2-layer KDA model, a 2-layer attention model and a 1:1 hybrid
can be trained here on MQAR (the synthetic task of the Kimi Linear report's section 5.1)
to find the number of pairs where each fails. This script trains each for a fixed number
of steps at a few pair counts on PyTorch's CPU build (the ``parity`` extra: ``make
parity`` installs it), records seconds per step and the accuracy reached, and writes
``data/mqar_training.json``. The chapter reads that file and prices the report's protocol
(up to 20,000 steps, four learning rates, lengths 256-2,048) from the measured step
times. Not part of ``make bench`` (it takes ten minutes or more).

The KDA layer here is the token-by-token recurrence in PyTorch (per-channel decay, delta
rule, sigmoid beta, L2-normalised q and k), written for autograd; no fused kernel exists
for a CPU. Usage: ``.venv/bin/python bench/mqar_training.py [--steps 600] [--pairs 8 32]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

OUT = Path(__file__).resolve().parent.parent / "data" / "mqar_training.json"
VOCAB, WIDTH, HEADS, BATCH, LR = 256, 64, 2, 32, 3e-3


def mqar_batch(batch: int, pairs: int, gen: torch.Generator):
    """Keys from the lower half of the vocabulary, values from the upper; then every key again as a
    query, shuffled. Targets only at the queries: the value that key was given."""
    keys = torch.stack([torch.randperm(VOCAB // 2, generator=gen)[:pairs] for _ in range(batch)])
    values = torch.randint(VOCAB // 2, VOCAB, (batch, pairs), generator=gen)
    order = torch.stack([torch.randperm(pairs, generator=gen) for _ in range(batch)])
    context = torch.stack([keys, values], -1).reshape(batch, 2 * pairs)
    x = torch.cat([context, torch.gather(keys, 1, order)], 1)
    y = torch.full_like(x, -100)
    y[:, 2 * pairs:] = torch.gather(values, 1, order)
    return x, y


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, T, 3, HEADS, WIDTH // HEADS).unbind(2))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, T, WIDTH))


class KDA(nn.Module):
    """Per-channel gated delta rule, one token at a time (the book's recurrence, for autograd)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.beta, self.decay = nn.Linear(WIDTH, HEADS), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        B, T, _ = x.shape
        d = WIDTH // HEADS
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, d).unbind(2)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        beta = torch.sigmoid(self.beta(x))
        g = -F.softplus(self.decay(x)).view(B, T, HEADS, d)
        state, outs = x.new_zeros(B, HEADS, d, d), []
        for t in range(T):
            state = state * g[:, t].exp()[..., None]
            err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)
            state = state + beta[:, t, :, None, None] * k[:, t, ..., None] * err[..., None, :]
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
        return self.out(torch.stack(outs, 1).reshape(B, T, WIDTH))


class Block(nn.Module):
    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.norm1, self.mixer, self.norm2 = nn.LayerNorm(WIDTH), mixer, nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


MODELS = {"attention": ("A", "A"), "kda": ("K", "K"), "hybrid": ("K", "A")}


def make_model(kind: str) -> nn.Module:
    layers = [Block(KDA() if c == "K" else Attention()) for c in MODELS[kind]]
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), *layers, nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))


def train(kind: str, pairs: int, steps: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), LR, weight_decay=0.0)
    start = time.perf_counter()
    for _ in range(steps):
        x, y = mqar_batch(BATCH, pairs, gen)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        x, y = mqar_batch(256, pairs, gen)
        hit = model(x).argmax(-1)[y >= 0] == y[y >= 0]
    return {"model": kind, "pairs": pairs, "tokens": 3 * pairs, "steps": steps, "seconds": round(seconds, 2),
            "seconds_per_step": round(seconds / steps, 4), "accuracy": round(hit.float().mean().item(), 4),
            "chance": round(2 / VOCAB, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="training steps per (model, pairs)")
    ap.add_argument("--pairs", type=int, nargs="+", default=[8, 32], help="key-value pairs per sequence")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for pairs in args.pairs:
        for kind in MODELS:
            rows.append(train(kind, pairs, args.steps))
            print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps({
        "what": "MQAR training on this machine's CPU: 2-layer models (width 64, 2 heads, vocabulary 256, batch 32, "
                "AdamW lr 3e-3), one seed; written by bench/mqar_training.py",
        "measured": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__, "threads": 1, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
