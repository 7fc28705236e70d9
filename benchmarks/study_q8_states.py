"""Which 8-bit format for AdamW's m and v inside the fused epilogue? A training study on CPU, no GPU needed.

For the roadmap design "8-bit block-wise states" (benchmarks/NOTES_kernel.md): the epilogue holds one [1, 128] row
of a W tile per block, so blocks are 128 consecutive elements of a row, one fp32 absmax each. The candidates:
  dyn8        bitsandbytes' dynamic 8-bit code (create_dynamic_map, reimplemented) -- signed for m, unsigned for
              v, as its 8-bit optimizers; blocks of 128 here, not its 256; quantize = nearest code of x / absmax (in a kernel: a search over a 256-entry table)
  e4m3        fp8 e4m3 of x / absmax * 448 (Hopper converts in hardware: cvt.rn.satfinite.e4m3x2.f32; torch's
              .to(torch.float8_e4m3fn) rounds the same way) for m and v
  e4m3_sqrtv  as e4m3, but v stored as sqrt(v) (half the dynamic range in log scale: small v no longer underflow)
  e4m3_sr     as e4m3, rounded stochastically to a neighbouring e4m3 value (unbiased: a v whose per-step change is
              below half a code step still moves on average)
  bf16        2-byte states rounded to nearest (what torch.optim keeps for bf16 parameters), for scale
against fp32 states. Every state is dequantized, updated by torch's AdamW arithmetic in fp32, re-quantized.
Model: a 2-layer causal transformer, character-level on this repository's text (README.md + NOTES), fp32 weights.
  python benchmarks/study_q8_states.py [--steps 400] [--seeds 0,1] [--lr 2e-3]
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK = 128


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), reimplemented: 256 sorted codes
    in [-1, 1] (signed) or [0, 1]; per decade 10**(i-6), i = 0..6, the midpoints of a linear grid over [0.1, 1] with
    2**i (signed, both signs) or 2**(i+1) points, plus 0 and 1."""
    data = []
    for i in range(7):
        n = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        b = torch.linspace(0.1, 1, n)
        means = ((b[:-1] + b[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        data += means + ([-v for v in means] if signed else [])
    data += [0.0, 1.0]
    assert len(data) == 256, len(data)
    return torch.tensor(sorted(data))


def _e4m3_stochastic(x: torch.Tensor) -> torch.Tensor:
    """x (|x| <= 448) rounded to one of its two neighbouring e4m3 values, up with probability equal to the
    distance from the lower one over the gap: unbiased (the study draws torch.rand; a kernel would use the
    stochastic_round.py hash with its own salt)."""
    a = x.abs()
    near = a.to(torch.float8_e4m3fn)
    bits = near.view(torch.uint8).to(torch.int16)
    nf = near.float()
    lo_bits = torch.where(nf > a, (bits - 1).clamp_min(0), bits)
    hi_bits = torch.where(nf > a, bits, (bits + 1).clamp_max(0x7E))     # 0x7E = 448, the largest finite
    lo = lo_bits.to(torch.uint8).view(torch.float8_e4m3fn).float()
    hi = hi_bits.to(torch.uint8).view(torch.float8_e4m3fn).float()
    gap = (hi - lo).clamp_min(1e-30)
    up = torch.rand_like(a) < (a - lo) / gap
    return torch.where(up, hi, lo) * x.sign()


class Quant:
    def __init__(self, kind: str):
        self.kind = kind
        self.maps = {True: dynamic_map(True), False: dynamic_map(False)}

    def roundtrip(self, x: torch.Tensor, signed: bool, is_v: bool, codes: bool = False):
        """x (fp32) -> what the 8-bit (or bf16) state holds after storing it, dequantized; ``codes``: also the
        stored codes (the value before the block scale), to tell a code that moved from a scale that did."""
        if self.kind in ("fp32", "bf16"):
            d = x if self.kind == "fp32" else x.bfloat16().float()
            return (d, d) if codes else d
        shape = x.shape
        rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
        k = rows.shape[1]
        pad = (-k) % BLOCK
        b = F.pad(rows, (0, pad)).reshape(rows.shape[0], -1, BLOCK)
        if self.kind == "e4m3_sqrtv" and is_v:
            b = b.clamp_min(0).sqrt()
        amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        if self.kind == "dyn8":
            code = self.maps[signed]
            y = (b / amax).clamp(-1, 1)
            mid = (code[1:] + code[:-1]) / 2
            q = code[torch.bucketize(y, mid)]
            d = q * amax
        elif self.kind == "e4m3_sr":
            q = _e4m3_stochastic(b / amax * 448)
            d = q / 448 * amax
        else:
            q = (b / amax * 448).to(torch.float8_e4m3fn).float()
            d = q / 448 * amax
        if self.kind == "e4m3_sqrtv" and is_v:
            d = d * d
        d = d.reshape(rows.shape[0], -1)[:, :k].reshape(shape)
        return (d, q.reshape(rows.shape[0], -1)[:, :k].reshape(shape)) if codes else d


class QAdamW(torch.optim.Optimizer):
    """torch's AdamW arithmetic with every m, v stored through ``quant`` after each step."""

    def __init__(self, params, quant: Quant, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.quant = quant
        # per step, the share of m / v elements whose stored code did not move: an update below half a code step is
        # rounded away (v moves by (1 - beta2) = 0.1 % per step, below e4m3's ~3 % half-step); with block scales
        # the value still moves with its block's absmax
        self.frozen = {"m": [], "v": []}
        self.codes = {}

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                t = st["step"]
                p.mul_(1 - g["lr"] * g["weight_decay"])
                m = st["m"].lerp(p.grad, 1 - b1)
                v = st["v"] * b2 + (1 - b2) * p.grad * p.grad
                denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(g["eps"])
                p.addcdiv_(m, denom, value=-g["lr"] / (1 - b1 ** t))
                # only 2-D weights get 8-bit states (as bitsandbytes' min_8bit_size: small tensors stay fp32)
                low = p.dim() == 2
                if low:
                    (m, cm), (v, cv) = self.quant.roundtrip(m, True, False, True), self.quant.roundtrip(v, False, True,
                                                                                                      True)
                    old = self.codes.get(p)
                    if old is not None:
                        self.frozen["m"].append((cm == old[0]).float().mean().item())
                        self.frozen["v"].append((cv == old[1]).float().mean().item())
                    self.codes[p] = (cm, cv)
                st["m"], st["v"] = m, v


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, vocab, d=128, layers=2, heads=4, seq=128):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def corpus():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    text = "".join(open(os.path.join(root, f), encoding="utf-8").read()
                   for f in ("README.md", "benchmarks/NOTES_kernel.md", "benchmarks/RESULTS.md"))
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    n = int(len(data) * 0.9)
    return data[:n], data[n:], len(chars)


def batches(data, n, seq, bsz, gen):
    for _ in range(n):
        i = torch.randint(0, len(data) - seq - 1, (bsz,), generator=gen)
        yield torch.stack([data[j:j + seq] for j in i]), torch.stack([data[j + 1:j + seq + 1] for j in i])


def run(kind, seed, steps, lr, train, val, vocab, seq=128, bsz=16):
    torch.manual_seed(seed)
    model = LM(vocab, seq=seq)
    opt = QAdamW(model.parameters(), Quant(kind), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for x, y in batches(train, steps, seq, bsz, gen):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        g = torch.Generator().manual_seed(1234)
        ev = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches(val, 20, seq, bsz, g)]
    late = {k: v[len(v) // 2:] for k, v in opt.frozen.items()}     # the second half of the run
    frozen = {k: sum(v) / max(1, len(v)) for k, v in late.items()}
    return sum(losses[-50:]) / 50, sum(ev) / len(ev), losses, frozen


def probe(steps, lr, train, vocab, kinds, at=(50, 200, 400, 600), seq=128, bsz=16):
    """Train with fp32 states; at the steps ``at``, store every 2-D weight's m, v through each format and compare
    the update it gives, m_hat / (sqrt(v_hat) + eps), with the fp32 states' (one step, same gradient history):
    relative L2 error and the largest |update| ratio (an underflowed v makes an update explode)."""
    torch.manual_seed(0)
    model = LM(vocab, seq=seq)
    opt = QAdamW(model.parameters(), Quant("fp32"), lr=lr)
    gen = torch.Generator().manual_seed(0)
    quants = {k: Quant(k) for k in kinds if k != "fp32"}
    out = []
    for t, (x, y) in enumerate(batches(train, steps, seq, bsz, gen), 1):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if t not in at:
            continue
        b1, b2 = opt.param_groups[0]["betas"]
        for kind, q in quants.items():
            num = den = 0.0
            worst = 0.0
            mag = [0.0, 0.0]     # sum |update|, quantized and fp32: a ratio above 1 is a larger effective step
            for p in model.parameters():
                if p.dim() != 2:
                    continue
                st = opt.state[p]
                m, v = st["m"], st["v"]
                ref = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + 1e-8)
                got = (q.roundtrip(m, True, False) / (1 - b1 ** t)) / \
                      ((q.roundtrip(v, False, True) / (1 - b2 ** t)).sqrt() + 1e-8)
                num += (got - ref).pow(2).sum().item()
                den += ref.pow(2).sum().item()
                worst = max(worst, (got.abs() / ref.abs().clamp_min(1e-3)).max().item())
                mag[0] += got.abs().sum().item()
                mag[1] += ref.abs().sum().item()
            out.append((t, kind, math.sqrt(num / den), worst, mag[0] / mag[1]))
            print(f"step {t:4d} {kind:11s} update rel. L2 error {math.sqrt(num / den):.2e}   "
                  f"largest |update| / |fp32 update| {worst:.1f}   sum |update| / fp32's {mag[0] / mag[1]:.4f}",
                  flush=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--kinds", default="fp32,bf16,dyn8,e4m3,e4m3_sqrtv,e4m3_sr")
    p.add_argument("--probe", action="store_true", help="only the per-step update error of each format")
    a = p.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    train, val, vocab = corpus()
    if a.probe:
        probe(a.steps, a.lr, train, vocab, a.kinds.split(","))
        return
    # the codes themselves: how finely each represents a state relative to its block's absmax
    for signed in (True, False):
        c = dynamic_map(signed)
        print(f"dynamic map ({'signed' if signed else 'unsigned'}): {c.numel()} codes, smallest nonzero "
              f"{c[c > 0].min().item():.1e}")
    rows = []
    for kind in a.kinds.split(","):
        for seed in (int(s) for s in a.seeds.split(",")):
            t0 = time.time()
            tr, ev, _, frozen = run(kind, seed, a.steps, a.lr, train, val, vocab)
            rows.append((kind, seed, tr, ev))
            print(f"{kind:11s} seed {seed}: train (last 50) {tr:.4f}  eval {ev:.4f}  unmoved per step (2nd half): "
                  f"m {frozen['m']:.1%} v {frozen['v']:.1%}  ({time.time() - t0:.0f} s)", flush=True)
    print("\n| states | train loss (last 50 steps), mean over seeds | eval loss | eval - fp32 |")
    print("|---|---|---|---|")
    base = [r[3] for r in rows if r[0] == "fp32"]
    b = sum(base) / len(base) if base else float("nan")
    for kind in a.kinds.split(","):
        rr = [r for r in rows if r[0] == kind]
        tr, ev = sum(r[2] for r in rr) / len(rr), sum(r[3] for r in rr) / len(rr)
        print(f"| {kind} | {tr:.4f} | {ev:.4f} | {ev - b:+.4f} |")


if __name__ == "__main__":
    main()
