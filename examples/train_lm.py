"""Train a byte-level, Llama-style decoder-only language model with FORGE.

    python examples/train_lm.py                      # tiny model on the stdlib's own source, a few CPU minutes
    python examples/train_lm.py --route off          # baseline: torch.compile(model) + torch.optim
    python examples/train_lm.py --route backend      # torch.compile(model, backend="forge", ...)
    python examples/train_lm.py --compare            # forge vs baseline, same seed, loss curves -> PNG
    python examples/train_lm.py --steps 200 --stop-after 100 --save ck.pt   # then: --steps 200 --resume ck.pt
    python examples/train_lm.py --size 1b --device cuda                     # bf16 autocast on CUDA
    python examples/train_lm.py --size 1b --steps 30 --eval-every 0 --results-json r.json   # a timed GPU run
    python examples/train_lm.py --hf                 # transformers.LlamaForCausalLM (--hf qwen2: Qwen2, tied)

Routes (``--route``):
  step     ``forge.compile_train_step``: forward, ``loss.backward()``, ``opt.step()`` and ``opt.zero_grad()``
           become one graph; every linear weight's dW is consumed by the AdamW update inside its GEMM.
  backend  ``torch.compile(model, backend="forge", options={"optimizer": opt})``, ordinary training loop.
  off      ``torch.compile(model)`` + ``torch.optim.AdamW``: the baseline.

The data is byte-level (vocab 256): by default the Python standard library's own ``*.py`` files (the
directory of the ``os`` module, sorted, capped at a few MB), or ``--data FILE``. The last 5% is held out
for the validation loss. Batches come from a seeded ``torch.Generator`` whose state is checkpointed, so
``--save``/``--resume`` continues exactly where the run stopped (bit-identical losses on CPU fp32).

Timing: tokens/s leave out the first ``--untimed-steps`` steps (compilation, autotuning, allocator warm-up);
peak memory is torch.cuda.max_memory_allocated over the training steps on CUDA, the process's max RSS on
CPU. ``--results-json PATH`` writes every number of the summary (and the per-step losses and times).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

try:
    import forge_compile as forge
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import forge_compile as forge

log = logging.getLogger("train_lm")

VOCAB = 256
COMPARE_EXACT = 20      # --compare: steps over which forge and the baseline must agree to 1e-4 (fp32)
# name: model shape and the defaults that go with it (each can be overridden on the command line).
SIZES = {
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, d_ff=384, seq_len=128, batch_size=16, lr=3e-3, steps=1200),
    "small": dict(d_model=512, n_layers=8, n_heads=8, d_ff=1408, seq_len=512, batch_size=16, lr=1e-3, steps=2000),
    # Llama-3.2-1B's trunk (d 2048, 16 layers, SwiGLU 8192) with multi-head attention and byte vocab: 1.07B params.
    "1b": dict(d_model=2048, n_layers=16, n_heads=32, d_ff=8192, seq_len=2048, batch_size=8, lr=3e-4, steps=1000),
}


# ---------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_tables(seq_len, head_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)                      # (T, head_dim), the "rotate half" layout
    return emb.cos(), emb.sin()


def apply_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.head_dim = d // n_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        # heads counted from the projection's width, not a stored count: under tensor parallelism a rank's
        # column-wise q/k/v shard holds n_heads / world of them (benchmarks/bench_tp_train_step.py)
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)     # bf16 under autocast (fp32 tables would upcast q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.up_proj = nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, d, n_heads, d_ff):
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.attn = Attention(d, n_heads)
        self.mlp_norm = RMSNorm(d)
        self.mlp = SwiGLU(d, d_ff)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A Llama-style decoder: pre-norm RMSNorm, rotary embeddings, causal SDPA, SwiGLU, lm_head untied by default."""

    def __init__(self, d_model, n_layers, n_heads, d_ff, max_seq_len, vocab=VOCAB, tied=False, checkpoint=False):
        super().__init__()
        # activation checkpointing per decoder layer: only each layer's input is saved, its forward runs again in
        # the backward (the fine-tuning regime where parameters + optimizer states, not activations, fill memory)
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(DecoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        if tied:   # one matrix for both (Llama-3.2 / Qwen2.5 style)
            self.lm_head.weight = self.embed.weight
        cos, sin = rotary_tables(max_seq_len, d_model // n_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:   # GPT-2 style init; residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(idx)
        for layer in self.layers:
            if self.checkpoint and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


# --hf FAMILY: (config class, model class, tied embeddings). Qwen2 is built tied, as its small checkpoints
# are: the shared embedding/lm_head matrix gets two gradient contributions and is left unfused (the report
# says so) while every projection is fused. tests/test_hf_models.py checks both against eager torch.optim.
HF_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", False),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", True),
}


class HFCausalLM(nn.Module):
    """A transformers decoder (random init from its config, nothing downloaded) behind the idx -> logits call."""

    def __init__(self, d_model, n_layers, n_heads, d_ff, max_seq_len, vocab=VOCAB, family="llama"):
        super().__init__()
        try:
            import transformers
        except ImportError:
            raise SystemExit("--hf needs the transformers package: pip install -e '.[hf]' "
                             "(or pip install 'transformers>=4.45'); nothing is downloaded, the model is "
                             "built from a config with random weights") from None
        cfg_name, model_name, tied = HF_FAMILIES[family]
        cfg = getattr(transformers, cfg_name)(
            vocab_size=vocab, hidden_size=d_model, intermediate_size=d_ff, num_hidden_layers=n_layers,
            num_attention_heads=n_heads, num_key_value_heads=n_heads, max_position_embeddings=max_seq_len,
            tie_word_embeddings=tied, use_cache=False, attn_implementation="sdpa")
        self.model = getattr(transformers, model_name)(cfg)

    def forward(self, idx):
        return self.model(input_ids=idx, use_cache=False).logits


def build_model(args):
    if args.hf:
        m = HFCausalLM(args.d_model, args.n_layers, args.n_heads, args.d_ff, args.seq_len, family=args.hf)
        if args.checkpoint_layers:
            m.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m
    return Llama(args.d_model, args.n_layers, args.n_heads, args.d_ff, args.seq_len,
                 checkpoint=args.checkpoint_layers)


def model_name(args):
    return HF_FAMILIES[args.hf][1] if args.hf else "Llama"


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------
def stdlib_corpus(max_bytes):
    """The standard library's own *.py files, concatenated up to max_bytes.

    Files are ordered by a hash of their relative path: deterministic, and the held-out tail is a mix of
    modules rather than one package. Test suites and the codec tables in encodings/ are left out (the
    tables are mostly generated ``0x00e4 -> LATIN SMALL LETTER A WITH DIAERESIS`` lines)."""
    root = os.path.dirname(os.__file__)
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        paths += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    paths.sort(key=lambda p: hashlib.sha1(p.replace(os.sep, "/").encode()).hexdigest())
    chunks, total = [], 0
    for p in paths:
        with open(os.path.join(root, p), "rb") as f:
            b = f.read()
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    return b"\n\n".join(chunks)[:max_bytes], f"{len(chunks)} stdlib .py files under {root}"


def load_data(args):
    if args.data:
        with open(args.data, "rb") as f:
            raw = f.read()
        desc = args.data
    else:
        raw, desc = stdlib_corpus(int(args.max_data_mb * 2**20))
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = max(int(len(data) * args.val_frac), args.seq_len + 2)
    train, val = data[:-n_val], data[-n_val:]
    if len(train) < args.seq_len + 2:
        raise SystemExit(f"{desc}: {len(data)} bytes is too little text for --seq-len {args.seq_len}")
    return train, val, desc


def get_batch(data, batch_size, seq_len, gen, device):
    ix = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    x = torch.stack([data[i:i + seq_len] for i in ix.tolist()]).long()
    y = torch.stack([data[i + 1:i + 1 + seq_len] for i in ix.tolist()]).long()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def unigram_entropy(data):
    """Entropy (nats) of the byte distribution: the loss of the best model that ignores context."""
    p = torch.bincount(data.long(), minlength=VOCAB).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------
def make_optimizer(model, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]       # matrices and the embedding
    no_decay = [p for p in model.parameters() if p.dim() < 2]     # RMSNorm gains
    # fused=True on CUDA (--fused-adamw): torch's fastest AdamW, so route off is the strongest baseline; forge
    # accepts it too and runs it for whatever it leaves unfused. Every route gets the same optimizer.
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if args.fused_adamw else {}))


def make_scheduler(opt, args):
    warmup = max(1, int(args.warmup_frac * args.steps))
    total = args.steps

    def lr_factor(step):        # linear warm-up to 1, then cosine to 0.1
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def lm_loss(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_train_step(route, model, opt, autocast, cuda_graphs=False, recompute_weight_copies=False,
                    cast_weights_in_update=False, clip_grad_norm=None, grad_accum=1, stochastic_rounding=False):
    """A callable (x, y) -> loss tensor that also updates the parameters, for the chosen route (``cuda_graphs``:
    route step replayed as one CUDA graph; ``recompute_weight_copies``, ``cast_weights_in_update``: see
    forge.compile_train_step; ``clip_grad_norm``: clip_grad_norm_(model.parameters(), it) before opt.step();
    ``grad_accum``: the batch split into that many passes, forward + backward each, the gradients accumulated
    before the one update; ``stochastic_rounding``: routes step and backend round the bf16 weights stochastically)."""
    def passes(x, y):
        return zip(x.chunk(grad_accum), y.chunk(grad_accum))

    def clip():
        if clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)

    if route == "step":
        @forge.compile_train_step(cuda_graphs=cuda_graphs, recompute_weight_copies=recompute_weight_copies,
                                  cast_weights_in_update=cast_weights_in_update,
                                  stochastic_rounding=stochastic_rounding)
        def train_step(x, y):
            total = 0.0
            for xi, yi in passes(x, y):   # traced per pass: each weight's update reads all passes' dY and X
                with autocast():
                    loss = lm_loss(model(xi), yi) / grad_accum
                loss.backward()
                total = total + loss.detach()
            clip()      # traced into the step: the fused weights' norms from dY and X, the clip in their update
            opt.step()
            opt.zero_grad(set_to_none=True)
            return total
        return train_step

    if route == "backend":
        if grad_accum > 1:
            raise SystemExit("--grad-accum needs --route step or off: the Dynamo route updates fused weights inside "
                             "each loss.backward(), so a second pass before opt.step() raises")
        if clip_grad_norm:
            raise SystemExit("--clip-grad-norm needs --route step or off: the Dynamo route updates fused weights inside "
                             "loss.backward(), before any gradient norm exists")
        if importlib.util.find_spec("forge_compile.backend") is None:
            raise SystemExit("--route backend needs forge_compile.backend (the Dynamo backend "
                             "torch.compile(model, backend='forge', options={'optimizer': opt})), which this "
                             "version of forge_compile does not have yet; use --route step or --route off")
        import forge_compile.backend  # noqa: F401  (registers backend="forge")
        # stochastic_rounding (--bf16-weights): every bf16 parameter rounded stochastically (fused weights in the
        # backward, the rest by forge's pre-step hook)
        cmodel = torch.compile(model, backend="forge", options={"optimizer": opt,
                                                                "stochastic_rounding": stochastic_rounding})
    elif route == "off":
        cmodel = torch.compile(model)
    else:
        raise ValueError(route)

    def train_step(x, y):
        total = 0.0
        for xi, yi in passes(x, y):
            with autocast():
                loss = lm_loss(cmodel(xi), yi) / grad_accum
            loss.backward()
            total = total + loss.detach()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total
    return train_step


@torch.no_grad()
def evaluate(model, val, args, autocast, device):
    """Mean loss over a fixed set of held-out batches (its own generator: training data order untouched)."""
    gen = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(args.eval_batches):
        x, y = get_batch(val, args.batch_size, args.seq_len, gen, device)
        with autocast():
            total += lm_loss(model(x), y).item()
    return total / args.eval_batches


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def fmt_bytes(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class Progress:
    """tqdm when it is installed and stderr is a terminal; otherwise a log line every ~10% of the run."""

    def __init__(self, start, total, enabled=True):
        self.bar = None
        self.total = total
        self.every = max(1, (total - start) // 10)
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(initial=start, total=total, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step, info):
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(info, refresh=False)
        elif step % self.every == 0 or step == self.total:
            log.info("step %d/%d  %s", step, self.total, info)

    def write(self, msg):
        if self.bar is not None:
            self.bar.write(msg)
        else:
            log.info("%s", msg)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def fusion_report(route, train_step, x, y):
    """The forge fusion report of the step just run (route step: the compiled step's own report, the same
    one forge.explain(train_step, x, y) returns, without tracing the step again; route backend: the last
    backward graph's)."""
    if route == "step":
        rep = train_step.last_report
        return str(rep if rep is not None else forge.explain(train_step, x, y))
    if route == "backend":
        import forge_compile.backend as fb
        reps = fb.last_reports()
        return "\n\n".join(str(r) for r in reps) if reps else None
    return None


def data_parallel(args):
    """(rank, world size, device) under torchrun (WORLD_SIZE > 1): the process group is made here (NCCL on CUDA, a GPU
    per rank; gloo on CPU), each rank trains on its own batches and DistributedDataParallel averages the gradients.
    (0, 1, --device) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, torch.device(args.device)
    import torch.distributed as dist
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


def replica_spread(model) -> float:
    """The largest difference of any parameter between the ranks (0.0: the replicas are equal)."""
    import torch.distributed as dist
    out = 0.0
    for p in model.parameters():
        every = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(every, p.detach().contiguous())
        out = max(out, max((e - every[0]).abs().max().item() for e in every))
    return out


def train(args):
    rank, world, device = data_parallel(args)
    if rank:
        log.setLevel(logging.WARNING)
    torch.manual_seed(args.seed)
    use_bf16 = device.type == "cuda" and not args.fp32
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext)

    train_data, val_data, desc = load_data(args)
    model = build_model(args).to(device)
    if args.bf16_weights:
        # no fp32 master weights: 2-byte weights and AdamW states; routes step and backend round them stochastically
        model = model.to(torch.bfloat16)
    opt = make_optimizer(model, args)
    sched = make_scheduler(opt, args)
    gen = torch.Generator().manual_seed(args.seed + rank)     # each rank its own batches
    start, losses, val_history = 0, [], []

    if args.resume:
        ck = torch.load(args.resume, map_location=device, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        gen.set_state(ck["data_rng"])
        start, losses, val_history = ck["step"], list(ck["losses"]), list(ck["val_history"])
        if ck.get("steps") != args.steps:
            log.warning("resuming a run planned for %s steps with --steps %d: the LR schedule changes",
                        ck.get("steps"), args.steps)
        log.info("resumed from %s at step %d", args.resume, start)

    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = args.batch_size * args.seq_len * world
    trained = model         # what the step calls: DDP's wrapper under torchrun (compile_train_step traces its
    if world > 1:           # synchronisation into the step and fuses the averaged weight gradients too)
        trained = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                      else None)
        log.info("data parallel: %d ranks (%s), %d tokens per rank per step", world,
                 torch.distributed.get_backend(), args.batch_size * args.seq_len)
    log.info("data: %s (%.2f MB train, %.2f MB val)", desc, len(train_data) / 1e6, len(val_data) / 1e6)
    log.info("model: %s %s, %.2fM parameters; route %s on %s, %s; %d steps x %d tokens",
             model_name(args), args.size, n_params / 1e6, args.route, device,
             "bf16 weights" if args.bf16_weights else "bf16 autocast" if use_bf16 else "fp32", args.steps, tokens_per_step)

    train_step = make_train_step(args.route, trained, opt, autocast, args.cuda_graphs, args.recompute_weight_copies,
                                 args.cast_weights_in_update, args.clip_grad_norm, args.grad_accum,
                                 args.bf16_weights)
    if args.bf16_weights and args.route == "step":
        # the rounding's random bits follow the step's call count: a resumed run goes on from its step
        train_step.round_calls = start
    elif args.bf16_weights and args.route == "backend":
        from forge_compile.backend import set_round_calls

        set_round_calls(opt, start)
    stop = min(args.steps, args.stop_after) if args.stop_after else args.steps
    # Steps left out of tokens/s: compilation (first step) and warm-up; at least one step is always timed.
    untimed = min(args.untimed_steps, max(0, stop - start - 1))
    progress = Progress(start, stop, enabled=not args.quiet and rank == 0)
    if args.route != "off":     # forge runs opt.step() inside the compiled step, which torch's check can't see
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
    timed_tokens, timed_s, untimed_s, step_times = 0, 0.0, 0.0, []
    t_start = time.perf_counter()
    x = y = None
    for step in range(start, stop):
        x, y = get_batch(train_data, args.batch_size, args.seq_len, gen, device)
        t0 = time.perf_counter()
        loss = train_step(x, y).item()          # .item() synchronizes: the timing is the step's
        dt = time.perf_counter() - t0
        sched.step()
        losses.append(loss)
        step_times.append(dt)
        if step - start < untimed:
            untimed_s += dt
        else:
            timed_tokens += tokens_per_step
            timed_s += dt
        if not math.isfinite(loss):
            raise RuntimeError(f"loss became {loss} at step {step + 1}")
        tps = timed_tokens / timed_s if timed_s else float("nan")
        progress.update(step + 1, f"loss {loss:.4f} | {tps:,.0f} tok/s | peak {fmt_bytes(peak_memory(device))}")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < stop:
            v = evaluate(model, val_data, args, autocast, device)
            val_history.append((step + 1, v))
            progress.write(f"step {step + 1}: val loss {v:.4f}")
    progress.close()
    wall_s = time.perf_counter() - t_start
    train_peak = peak_memory(device)            # before the final evaluation

    val_loss = evaluate(model, val_data, args, autocast, device)
    val_history.append((stop, val_loss))
    spread = replica_spread(model) if world > 1 else None
    if args.save and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "step": stop, "steps": args.steps, "data_rng": gen.get_state(), "losses": losses,
                    "val_history": val_history, "size": args.size, "hf": args.hf}, args.save)
        log.info("saved step %d to %s", stop, args.save)

    report = fusion_report(args.route, train_step, x, y) if x is not None else None
    if world > 1:
        torch.distributed.destroy_process_group()
    n_timed = len(step_times) - untimed
    return {
        "route": args.route, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "model": model_name(args), "size": args.size, "n_params": n_params,
        "config": {k: getattr(args, k) for k in ("d_model", "n_layers", "n_heads", "d_ff", "seq_len",
                                                 "batch_size", "lr", "steps", "fused_adamw", "seed")},
        "dtype": "bf16 weights" if args.bf16_weights else "bf16 autocast" if use_bf16 else "fp32",
        "losses": losses, "step_times_s": step_times,
        "final_train_loss": losses[-1] if losses else float("nan"),
        "val_loss": val_loss, "val_history": val_history, "unigram_entropy": unigram_entropy(train_data),
        "tokens_per_step": tokens_per_step, "untimed_steps": untimed, "timed_steps": n_timed,
        "tokens_per_s": timed_tokens / timed_s if timed_s else float("nan"),
        "step_ms": 1e3 * timed_s / n_timed if n_timed else float("nan"),
        "first_step_s": step_times[0] if step_times else None, "untimed_s": untimed_s,
        "train_s": untimed_s + timed_s, "wall_s": wall_s,
        "peak_memory_bytes": train_peak, "fusion_report": report,
        "rank": rank, "world_size": world, "replica_spread": spread,
    }


def print_summary(r):
    print(f"\n== {r['model']} {r['size']} ({r['n_params'] / 1e6:.2f}M params) | route {r['route']} | "
          f"{r['device_name'] or r['device']}, {r['dtype']} ==")
    print(f"final train loss   {r['final_train_loss']:.4f} nats")
    print(f"validation loss    {r['val_loss']:.4f} nats")
    gap = r["unigram_entropy"] - r["val_loss"]
    print(f"unigram baseline   {r['unigram_entropy']:.4f} nats (byte entropy of the training text; "
          f"the validation loss is {abs(gap):.3f} nats {'below' if gap >= 0 else 'above'} it)")
    print(f"throughput         {r['tokens_per_s']:,.0f} tokens/s, {r['step_ms']:.1f} ms/step over "
          f"{r['timed_steps']} steps (left out: {r['untimed_steps']} warm-up steps, {r['untimed_s']:.1f} s; "
          f"the first, with compilation, {r['first_step_s'] or 0:.1f} s)")
    print(f"peak memory        {fmt_bytes(r['peak_memory_bytes'])} "
          f"({'max allocated' if r['device'].startswith('cuda') else 'max RSS of the process'})")
    if r.get("world_size", 1) > 1:
        print(f"data parallel      {r['world_size']} ranks (DistributedDataParallel), tokens/s over all of them; "
              f"replicas {'equal' if r['replica_spread'] == 0 else 'DIFFER by %.3g' % r['replica_spread']}")
    if r.get("fusion_report"):
        print("\n" + r["fusion_report"])


# ---------------------------------------------------------------------------------------------------
# --compare: forge (route step) vs the baseline (route off) from the same seed
# ---------------------------------------------------------------------------------------------------
def compare(args, argv):
    """Each route runs in its own process so that peak memory (max RSS on CPU) is its own."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--compare needs matplotlib for the plot: pip install -e '.[example]' "
                         "(or pip install matplotlib)") from None
    passthrough = [a for a in _strip(argv, {"--compare": 0, "--route": 1, "--plot": 1, "--results-json": 1})]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for route in ("step", "off"):
            out = os.path.join(tmp, f"{route}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--route", route,
                   "--results-json", out, "--quiet"]
            log.info("compare: running route %s", route)
            subprocess.run(cmd, check=True)
            with open(out) as f:
                results[route] = json.load(f)
    a, b = results["step"]["losses"], results["off"]["losses"]
    diffs = [abs(p - q) for p, q in zip(a, b)]
    max_abs = max(diffs)
    # Two fp32 runs whose matmuls sum in different orders start identical and then drift apart (Adam
    # amplifies last-bit differences; on the default run |diff| passes 1e-4 after ~50 steps). So the
    # check is: (1) the first COMPARE_EXACT steps agree to 1e-4 absolute -- any real difference in the
    # update (a hyper-parameter, a skipped weight) shows there at once -- and (2) after the run, the mean
    # loss over the last 10% of steps agrees to --compare-rtol relative (default 1e-2: the runs are then
    # statistically equal; on the default 1200-step run that mean differed by 2e-4 and 1.4e-3 in two tries).
    n_exact = min(COMPARE_EXACT, len(a))
    early_abs = max(diffs[:n_exact])
    tail = max(1, len(a) // 10)
    mean_a, mean_b = sum(a[-tail:]) / tail, sum(b[-tail:]) / tail
    tail_rel = abs(mean_a - mean_b) / abs(mean_b)
    drift = next((i + 1 for i, d in enumerate(diffs) if d > 1e-4), None)
    fp32 = results["off"]["device"] == "cpu" or args.fp32
    agree = (early_abs <= 1e-4 and tail_rel <= args.compare_rtol) if fp32 else None

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for route, label in (("step", "forge (compile_train_step)"), ("off", "baseline (torch.compile + torch.optim)")):
        r = results[route]
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], lw=1.2,
                label=f"{label}: peak {fmt_bytes(r['peak_memory_bytes'])}, {r['tokens_per_s']:,.0f} tok/s")
    ax.axhline(results["off"]["unigram_entropy"], color="gray", ls="--", lw=0.8, label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/byte)")
    ax.set_title(f"byte-level {results['off']['model']} {args.size} on {results['off']['device']}: |loss diff| {early_abs:.1e} "
                 f"over the first {n_exact} steps, {tail_rel:.1e} rel. over the last {tail}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)
    with open(os.path.splitext(args.plot)[0] + ".json", "w") as f:      # the numbers behind the plot
        json.dump(results, f)

    for route in ("step", "off"):
        print_summary(results[route])
    print(f"\ncompare: max |loss_forge - loss_baseline| over {len(a)} steps = {max_abs:.3e} "
          f"(first {n_exact} steps: {early_abs:.3e}; first step above 1e-4: {drift or 'none'})")
    print(f"compare: mean loss over the last {tail} steps: forge {mean_a:.5f}, baseline {mean_b:.5f}, "
          f"relative difference {tail_rel:.3e}")
    if agree is not None:
        print(f"compare: {'PASS' if agree else 'FAIL'} (fp32: the first {n_exact} losses agree to 1e-4 and the "
              f"last-10% mean losses to {args.compare_rtol:g} relative)")
    print(f"compare: loss curves written to {args.plot}")
    return {"forge": results["step"], "baseline": results["off"], "max_abs_diff": max_abs,
            "early_max_abs_diff": early_abs, "tail_mean_rel_diff": tail_rel, "first_drift_step": drift,
            "agree": agree, "plot": args.plot}


def _strip(argv, flags):
    """argv without the given flags (flag -> number of values it takes; also handles --flag=value)."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = flags[name] if "=" not in a else 0
            continue
        out.append(a)
    return out


# ---------------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="tiny",
                   help="tiny: 0.9M params, 1200 steps (CPU minutes); small: 26M; 1b: 1.07B (GPU)")
    p.add_argument("--hf", nargs="?", const="llama", choices=HF_FAMILIES, metavar="FAMILY",
                   help="a transformers model built from its config, random init, nothing downloaded: "
                        "llama (the default: LlamaForCausalLM) or qwen2 (Qwen2ForCausalLM, tied embeddings)")
    p.add_argument("--route", choices=("step", "backend", "off"), default="step")
    p.add_argument("--data", help="a text file to train on (default: the Python standard library's source)")
    p.add_argument("--max-data-mb", type=float, default=4.0, help="cap on the default stdlib corpus")
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--steps", type=int, help="length of the run (and of the LR schedule)")
    p.add_argument("--stop-after", type=int, help="stop after this step (the schedule still plans --steps)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=100, help="0: only at the end")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--checkpoint-layers", action="store_true",
                   help="activation checkpointing per decoder layer (torch.utils.checkpoint; --hf: transformers' "
                        "gradient_checkpointing_enable): recomputed in the backward, fused as usual")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="route step: replay the step as one CUDA graph (compile_train_step(cuda_graphs=True))")
    p.add_argument("--recompute-weight-copies", action="store_true",
                   help="route step: cast autocast's weight copies again in the backward instead of keeping them "
                        "(less memory, one more cast per step)")
    p.add_argument("--cast-weights-in-update", action="store_true",
                   help="route step: each fused update writes its weight's autocast copy for the next forward "
                        "(one cast kernel less per weight and step; the copies stay between steps)")
    p.add_argument("--clip-grad-norm", type=float, metavar="MAX",
                   help="clip_grad_norm_(model.parameters(), MAX) before each opt.step() (routes step and off)")
    p.add_argument("--bf16-weights", action="store_true",
                   help="bf16 parameters and AdamW states, no fp32 master weights; route step rounds every update "
                        "stochastically (compile_train_step(stochastic_rounding=True)), route backend too (options "
                        "stochastic_rounding=True), route off is "
                        "torch.optim's bf16 arithmetic (round to nearest)")
    p.add_argument("--grad-accum", type=int, default=1, metavar="K",
                   help="split each batch into K passes, backward() each, one opt.step() (routes step and off; "
                        "route step fuses a weight where all passes' dY and X are at most half its fp32 dW)")
    p.add_argument("--fused-adamw", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.optim.AdamW(fused=True) (default: on CUDA only)")
    p.add_argument("--untimed-steps", type=int, default=3,
                   help="first steps left out of tokens/s (compilation, autotuning, allocator warm-up)")
    p.add_argument("--save", metavar="PATH", help="checkpoint at the end (model, optimizer, scheduler, step, data RNG)")
    p.add_argument("--resume", metavar="PATH")
    p.add_argument("--compare", action="store_true", help="run route step and route off, plot both loss curves")
    p.add_argument("--compare-rtol", type=float, default=1e-2,
                   help="--compare: relative tolerance on the mean loss of the last 10%% of steps (fp32)")
    p.add_argument("--plot", default="train_lm_compare.png", help="where --compare writes its PNG")
    p.add_argument("--results-json", metavar="PATH",
                   help="write the results (losses, step times, tokens/s, peak memory, report) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    for k in ("d_model", "n_layers", "n_heads", "d_ff"):
        p.add_argument("--" + k.replace("_", "-"), type=int, help="override the --size preset")
    args = p.parse_args(argv)
    for k, v in SIZES[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.fused_adamw is None:
        args.fused_adamw = torch.device(args.device).type == "cuda"
    if args.grad_accum < 1 or args.batch_size % args.grad_accum:
        p.error(f"--grad-accum {args.grad_accum} must divide --batch-size {args.batch_size}")
    return args


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.compare:
        return compare(args, argv)
    results = train(args)
    if results["rank"]:     # under torchrun rank 0 reports
        return results
    if args.results_json:
        with open(args.results_json, "w") as f:
            json.dump(results, f, indent=1)
    if not (args.results_json and args.quiet):      # --compare's subprocesses: it prints both at the end
        print_summary(results)
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("forge_compile").setLevel(logging.WARNING)   # its report is printed at the end
    out = main()
    sys.exit(1 if isinstance(out, dict) and out.get("agree") is False else 0)
