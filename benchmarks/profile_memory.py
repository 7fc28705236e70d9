"""What is alive at the peak of one steady-state train step (issue 5: where do the routes' peaks sit?).

  python3 benchmarks/profile_memory.py --routes baseline,step,backend --mb 8 --out DIR

Builds the model and routes of bench_train_step.py (same code, --quick shape by default), each route in its own
subprocess (clean allocator, clean Dynamo caches). Per route: --warmup steps (the first compiles), then
torch.cuda.memory._record_memory_history around ONE steady-state step, torch.cuda.memory._snapshot(), stop.

The snapshot's device trace is replayed: allocated bytes = memory_allocated() before the step + alloc sizes -
free_requested sizes (the allocator's allocated_bytes stat drops at free_requested; free_completed only
returns memory to the cache). The peak is the first event where that running sum is largest; the live set
there = the blocks allocated in the step and not yet freed + the blocks that existed before the step and
were not yet freed (those have no alloc event: they are found as free_requested events without an alloc, or
as blocks still active in the snapshot's segments; parameters, optimizer states and the batch are named by
address). Every live block gets a label from its allocation stack: the innermost Inductor output-code frame
(file:line and that line's source, e.g. ``buf12 = empty_strided_cuda((8192, 32000), ...)``, shape parsed
from it), else the innermost frame in forge_compile/, torch/optim/, the model file or this benchmark.
Trace sizes are requested sizes; the replay rounds them up as the allocator does (512 B), but a large block
can also hold an unsplit remainder (< 1 MiB) that the trace does not show: the replayed peak can sit a little
below torch.cuda.max_memory_allocated (both are printed).

Writes DIR/profile_memory_<route>.md and .json per route and DIR/profile_memory.md (all routes); prints
the same. Logs of the workers go to a temporary directory (their tail is printed on a failure).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import bench_train_step as B  # noqa: E402

MIB = 2 ** 20
GIB = 2 ** 30
MODEL_FILE = os.path.join(B.ROOT, "examples", "train_lm.py")
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


# ---------------------------------------------------------------------------------------------------
# Frames -> labels (pure; unit-tested with a fake snapshot)
# ---------------------------------------------------------------------------------------------------
_EMPTY_RE = re.compile(r"^\s*(\w+)\s*=\s*(?:torch\.)?empty_strided\w*\(\s*\(([^()]*)\)\s*,\s*\(([^()]*)\)\s*,"
                       r"\s*(?:dtype\s*=\s*)?torch\.(\w+)")
_ASSIGN_RE = re.compile(r"^\s*(\w+)\s*=\s*(.*)$")


def is_inductor_file(filename, inductor_dirs=()):
    """An Inductor output-code module: under the Inductor cache dir (default /tmp/torchinductor_<user>)."""
    if not filename.endswith(".py"):
        return False
    if any(d and filename.startswith(d.rstrip(os.sep) + os.sep) for d in inductor_dirs):
        return True
    return any(part.startswith("torchinductor") for part in filename.split(os.sep)[:-1])


class Sources:
    """Lines of source files, read once (the Inductor files exist only on the machine that compiled)."""

    def __init__(self):
        self._files = {}

    def line(self, filename, lineno):
        if filename not in self._files:
            try:
                with open(filename, errors="replace") as f:
                    self._files[filename] = f.read().splitlines()
            except OSError:
                self._files[filename] = None
        lines = self._files[filename]
        if not lines or not 1 <= lineno <= len(lines):
            return None
        return lines[lineno - 1].strip()


def short_name(filename):
    """An Inductor output file's basename, its hash cut to 12 characters (cdmuh5tg3dmh.py)."""
    base = os.path.basename(filename)
    return base if len(base) <= 20 else base[:12] + ".py"


def parse_inductor_line(src):
    """(buffer name, shape, stride, dtype) of ``bufN = empty_strided_cuda((...), (...), torch.float32)``,
    else (assigned name or None, None, None, None)."""
    if not src:
        return None, None, None, None
    m = _EMPTY_RE.match(src)
    if m:
        def tup(s):     # None where a size is symbolic
            vals = [v for v in s.replace(" ", "").split(",") if v]
            return [int(v) for v in vals] if all(v.lstrip("-").isdigit() for v in vals) else None
        return m.group(1), tup(m.group(2)), tup(m.group(3)), m.group(4)
    m = _ASSIGN_RE.match(src)
    return (m.group(1) if m else None), None, None, None


def _rel(filename):
    for base in (os.path.dirname(TORCH_DIR.rstrip(os.sep)) + os.sep, B.ROOT + os.sep):
        if filename.startswith(base):
            return filename[len(base):]
    return filename


def _preferred(filename):
    return ("/forge_compile/" in filename or "/torch/optim/" in filename
            or filename == MODEL_FILE or filename.endswith(os.sep + os.path.join("examples", "train_lm.py"))
            or filename.startswith(BENCH_DIR + os.sep))


def phase_of(frames, inductor_dirs=()):
    """forward / backward / optimizer / forge step graph / ..., from the whole allocation stack."""
    if not frames:      # C++ only: e.g. the autograd engine's device thread (AccumulateGrad)
        return "no Python frames"
    files = [f.get("filename", "") for f in frames]
    names = [f.get("name", "") for f in frames]
    if any("/torch/optim/" in fn for fn in files):
        return "optimizer (torch.optim)"
    autograd = [n for fn, n in zip(files, names)
                if "/torch/_functorch/" in fn or "/torch/autograd/" in fn or fn.endswith("/torch/_tensor.py")]
    if any("backward" in n for n in autograd):
        return "backward"
    ind = any(is_inductor_file(fn, inductor_dirs) for fn in files)
    if any("/forge_compile/capture.py" in fn for fn in files):     # forward + backward + update: one graph
        return "forge train-step graph" if ind else "forge train-step (outside the graph)"
    if any("forward" in n for n in autograd) or (ind and any("/torch/_dynamo/" in fn for fn in files)):
        return "forward"
    if any("/forge_compile/" in fn for fn in files):
        return "forge"
    return "compiled graph" if ind else "eager"


def label_frames(frames, sources, inductor_dirs=()):
    """A label for one allocation stack (innermost frame first, as the snapshot gives them)."""
    for k, f in enumerate(frames):
        fn = f.get("filename", "")
        if is_inductor_file(fn, inductor_dirs):
            src = sources.line(fn, f.get("line", 0))
            buf, shape, stride, dtype = parse_inductor_line(src)
            base = short_name(fn)
            text = (src or "<source not readable>")[:110]
            via = next((g for g in frames[:k] if _preferred(g.get("filename", ""))), None)
            if via is not None:     # e.g. a workspace allocated inside a forge kernel's launcher
                text += f" [via {_rel(via['filename'])}:{via.get('line')} {via.get('name', '')}]"
            return dict(label=f"{base}:{f.get('line')} {text}", kind="inductor", file=base, line=f.get("line"),
                        buf=buf, shape=shape, stride=stride, dtype=dtype)
    pick = next((f for f in frames if _preferred(f.get("filename", ""))), None)
    kind = "code"
    if pick is None:
        pick = next((f for f in frames if not f.get("filename", "").startswith(TORCH_DIR)
                     and not f.get("filename", "").startswith("<")), None)
        kind = "other"
    if pick is None and frames:
        pick, kind = frames[0], "torch"
    if pick is None:
        return dict(label="<no Python frames: C++ only, e.g. the autograd engine's thread>", kind="none")
    fn = pick.get("filename", "")
    src = sources.line(fn, pick.get("line", 0)) or ""
    return dict(label=f"{_rel(fn)}:{pick.get('line')} {pick.get('name', '')}: {src[:90]}".rstrip(": "),
                kind=kind, file=os.path.basename(fn), line=pick.get("line"))


def stack_summary(frames, inductor_dirs=(), n=10):
    """The frames worth reading (Inductor files, forge, torch.optim, autograd/AOT wrappers, model, bench)."""
    out = []
    for f in frames:
        fn = f.get("filename", "")
        keep = (is_inductor_file(fn, inductor_dirs) or _preferred(fn) or "/torch/_functorch/" in fn
                or "/torch/autograd/" in fn)
        if keep:
            item = f"{short_name(fn) if is_inductor_file(fn, inductor_dirs) else _rel(fn)}:{f.get('line')} " \
                   f"{f.get('name', '')}"
            if not out or out[-1] != item:
                out.append(item)
    return out[:n]


# ---------------------------------------------------------------------------------------------------
# Snapshot replay (pure; unit-tested)
# ---------------------------------------------------------------------------------------------------
def rounded(size):
    """The allocator's block size for a request (round_size: at least 512 B, a multiple of 512 B). Large
    blocks can hold up to 1 MiB more (an unsplit remainder): that slack is not in the trace."""
    return 512 if size < 512 else (size + 511) // 512 * 512


def analyse_snapshot(snapshot, allocated_before, device=0, known=None, inductor_dirs=(), top=25,
                     measured_peak=None, max_entries=None):
    """Peak of allocated bytes during the recorded step and what is live there.

    known: {storage address: category label} for blocks that existed before the step (params, states, ...).
    Returns a JSON-able dict (bytes as ints)."""
    known = known or {}
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    sources = Sources()
    warnings = []
    if max_entries and len(trace) >= max_entries:
        warnings.append(f"trace has {len(trace)} entries = max_entries: the ring buffer wrapped, early events "
                        "are lost and the replay is wrong; raise --max-entries")

    # Pass 1: running allocated bytes, the peak's event index (first maximum), pre-existing frees.
    cur = peak = allocated_before
    peak_i = -1
    live = {}
    pre_freed = {}          # addr -> (size, free event index, frames of the free)
    n_alloc = n_free = 0
    for i, e in enumerate(trace):
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = i
            cur += rounded(e["size"])
            n_alloc += 1
            if cur > peak:
                peak, peak_i = cur, i
        elif a == "free_requested":
            n_free += 1
            if e["addr"] in live:
                cur -= rounded(trace[live.pop(e["addr"])]["size"])
            else:
                pre_freed.setdefault(e["addr"], (rounded(e["size"]), i, e.get("frames") or []))
                cur -= rounded(e["size"])
        elif a == "oom":
            warnings.append(f"OOM event at trace index {i}: {e.get('size')} bytes requested")
    end_live = set(live)
    final_allocated = cur

    # Pass 2: the live set at the peak.
    live = {}
    for i, e in enumerate(trace[:peak_i + 1]):
        if e.get("action") == "alloc":
            live[e["addr"]] = i
        elif e.get("action") == "free_requested":
            live.pop(e["addr"], None)

    # Blocks from before the step alive at the peak: freed after it, or still active at the snapshot.
    pre = []
    for addr, (size, fi, fframes) in pre_freed.items():
        if fi > peak_i:
            pre.append(dict(addr=addr, size=size, freed_at=fi, free_frames=fframes))
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated" or blk["address"] in end_live or blk["address"] in pre_freed:
                continue
            pre.append(dict(addr=blk["address"], size=blk["size"], freed_at=None,
                            free_frames=[]))

    groups = {}

    def add(key, size, info, phase):
        g = groups.setdefault(key, dict(label=key, bytes=0, count=0, kind=info.get("kind"), phase=phase,
                                        shapes=[], dtype=info.get("dtype")))
        g["bytes"] += size
        g["count"] += 1
        if info.get("shape") is not None and info["shape"] not in g["shapes"] and len(g["shapes"]) < 3:
            g["shapes"].append(info["shape"])

    by_phase = {}
    pre_bytes = 0
    for b in pre:
        pre_bytes += b["size"]
        cat = known.get(b["addr"])
        if cat is not None:
            add(f"[before step] {cat}", b["size"], dict(kind="before"), "before step")
        elif b["freed_at"] is not None:
            info = label_frames(b["free_frames"], sources, inductor_dirs)
            add(f"[before step, freed later at] {info['label']}", b["size"], dict(kind="before"), "before step")
        else:
            add("[before step] other, still alive after the step", b["size"], dict(kind="before"), "before step")
    by_phase["before step"] = pre_bytes
    step_bytes = 0
    for addr, i in live.items():
        e = trace[i]
        frames = e.get("frames") or []
        info = label_frames(frames, sources, inductor_dirs)
        ph = phase_of(frames, inductor_dirs)
        size = rounded(e["size"])
        add(info["label"], size, info, ph)
        by_phase[ph] = by_phase.get(ph, 0) + size
        step_bytes += size

    rows = sorted(groups.values(), key=lambda g: -g["bytes"])
    peak_event = None
    if peak_i >= 0:
        e = trace[peak_i]
        frames = e.get("frames") or []
        peak_event = dict(index=peak_i, size=rounded(e["size"]),
                          label=label_frames(frames, sources, inductor_dirs)["label"],
                          phase=phase_of(frames, inductor_dirs), stack=stack_summary(frames, inductor_dirs))

    # Where the memory goes over the step: per allocation site family (Inductor file or phase), the
    # largest running total reached by one of its allocations.
    sites = {}
    cur = allocated_before
    inlive = {}
    for i, e in enumerate(trace):
        a = e.get("action")
        if a == "alloc":
            inlive[e["addr"]] = rounded(e["size"])
            cur += rounded(e["size"])
            frames = e.get("frames") or []
            ind = next((short_name(f["filename"]) for f in frames
                        if is_inductor_file(f.get("filename", ""), inductor_dirs)), None)
            ph = phase_of(frames, inductor_dirs)
            key = f"{ind} ({ph})" if ind else ph
            s = sites.setdefault(key, dict(site=key, first=i, last=i, allocs=0, alloc_bytes=0, max_allocated=0,
                                           lines=None))
            s["last"] = i
            if ind:
                ln = next(f.get("line", 0) for f in frames if is_inductor_file(f.get("filename", ""), inductor_dirs))
                s["lines"] = [min(ln, s["lines"][0]), max(ln, s["lines"][1])] if s["lines"] else [ln, ln]
            s["allocs"] += 1
            s["alloc_bytes"] += rounded(e["size"])
            s["max_allocated"] = max(s["max_allocated"], cur)
        elif a == "free_requested":
            cur -= inlive.pop(e["addr"], rounded(e["size"]))
    timeline = sorted(sites.values(), key=lambda s: s["first"])
    if peak_event:
        pe_file = next((f for f in (trace[peak_i].get("frames") or [])
                        if is_inductor_file(f.get("filename", ""), inductor_dirs)), None)
        if pe_file:
            base = short_name(pe_file["filename"])
            ranges = [s["lines"] for s in timeline if s["lines"] and s["site"].startswith(base + " (")]
            rng = [min(r[0] for r in ranges), max(r[1] for r in ranges)] if ranges else None
            peak_event.update(line=pe_file.get("line"), graph_alloc_lines=rng)

    out = dict(peak_bytes=peak, peak_index=peak_i, n_events=len(trace), n_alloc=n_alloc, n_free_requested=n_free,
               allocated_before=allocated_before, allocated_after=final_allocated, measured_peak=measured_peak,
               live_before_step_bytes=pre_bytes, live_allocated_in_step_bytes=step_bytes,
               unaccounted_bytes=peak - pre_bytes - step_bytes, by_phase=by_phase, peak_event=peak_event,
               top=rows[:top], n_labels=len(rows), timeline=timeline[:20], warnings=warnings)
    return out


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------
def _gib(n):
    return "-" if n is None else f"{n / GIB:.3f}"


def render(route, cfg, an):
    o = [f"## {route}: micro-batch {cfg['mb']} ({cfg['mb'] * cfg['seq_len']} tokens), d_model {cfg['d_model']}, "
         f"{cfg['layers']} layers, vocab {cfg['vocab']}" + (f"; {cfg['note']}" if cfg.get("note") else "")]
    o.append(f"peak {_gib(an['peak_bytes'])} GiB replayed (torch.cuda.max_memory_allocated "
             f"{_gib(an.get('measured_peak'))} GiB); allocated before the step {_gib(an['allocated_before'])} GiB, "
             f"after {_gib(an['allocated_after'])} GiB; trace {an['n_events']} events ({an['n_alloc']} allocs), "
             f"peak at event {an['peak_index']}")
    pe = an.get("peak_event")
    if pe:
        o.append(f"peak reached by: alloc {pe['size'] / MIB:.1f} MiB at `{pe['label']}` -- phase: **{pe['phase']}**"
                 + (f" (line {pe['line']}; this graph allocates on lines {pe['graph_alloc_lines'][0]}-"
                    f"{pe['graph_alloc_lines'][1]})" if pe.get("graph_alloc_lines") else ""))
        if pe["stack"]:
            o.append("stack (innermost first): " + " <- ".join(pe["stack"]))
    else:
        o.append("peak = the start of the step (no allocation in the step went above it)")
    o.append("live at the peak by phase of allocation (GiB): " + ", ".join(
        f"{k} {_gib(v)}" for k, v in sorted(an["by_phase"].items(), key=lambda kv: -kv[1]))
        + (f"; unaccounted {_gib(an['unaccounted_bytes'])}" if abs(an["unaccounted_bytes"]) >= MIB else ""))
    o += ["", f"top {len(an['top'])} of {an['n_labels']} live labels at the peak:", "",
          "| MiB | n | phase | label | shape dtype |", "|---:|---:|---|---|---|"]
    for r in an["top"]:
        shp = " ".join(str(tuple(s)) for s in r["shapes"]) + (f" {r['dtype']}" if r.get("dtype") else "")
        o.append(f"| {r['bytes'] / MIB:.1f} | {r['count']} | {r['phase']} | `{r['label'].replace('|', '/')}` | "
                 f"{shp} |")
    if an["timeline"]:
        o += ["", "allocation sites over the step (first/last alloc event, max allocated GiB when they allocated):",
              "", "| site | events | Inductor lines | allocs | MiB allocated | max GiB |",
              "|---|---|---|---:|---:|---:|"]
        for s in an["timeline"]:
            lines = f"{s['lines'][0]}-{s['lines'][1]}" if s.get("lines") else "-"
            o.append(f"| {s['site']} | {s['first']}-{s['last']} | {lines} | {s['allocs']} | "
                     f"{s['alloc_bytes'] / MIB:.0f} | {_gib(s['max_allocated'])} |")
    for w in an.get("warnings", []):
        o.append(f"WARNING: {w}")
    return "\n".join(o)


# ---------------------------------------------------------------------------------------------------
# Worker: one route in this process (CUDA only)
# ---------------------------------------------------------------------------------------------------
def _known_addresses(model, opt, tensors):
    known = {}
    for p in model.parameters():
        known.setdefault(p.untyped_storage().data_ptr(), "model parameters (fp32 master)")
        if p.grad is not None:
            known.setdefault(p.grad.untyped_storage().data_ptr(), "parameter .grad (left from warm-up)")
    for st in opt.state.values():
        for k, t in st.items():
            if isinstance(t, torch.Tensor):
                known.setdefault(t.untyped_storage().data_ptr(), f"optimizer state '{k}'")
    for name, t in tensors.items():
        known.setdefault(t.untyped_storage().data_ptr(), name)
    return known


def _inductor_dirs():
    dirs = []
    with contextlib.suppress(Exception):
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        dirs.append(os.path.realpath(cache_dir()))
        dirs.append(cache_dir())
    return dirs


class CudaMemory:
    """The CUDA allocator calls of the worker (a test passes a fake to run the worker on CPU)."""

    def device(self):
        return torch.device("cuda", torch.cuda.current_device())

    def name(self, device):
        return torch.cuda.get_device_name(device)

    def sync(self):
        torch.cuda.synchronize()

    def reset_peak(self):
        torch.cuda.reset_peak_memory_stats()

    def allocated(self):
        return torch.cuda.memory_allocated()

    def max_allocated(self):
        return torch.cuda.max_memory_allocated()

    def start(self, max_entries):
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=max_entries)

    def snapshot(self):
        return torch.cuda.memory._snapshot()

    def stop(self):
        torch.cuda.memory._record_memory_history(enabled=None)


def run_worker(cfg, mem=None):
    mem = mem or CudaMemory()
    route, mb = cfg["route"], cfg["mb"]
    device = mem.device()
    t0 = time.monotonic()
    Llama = B.load_llama()
    with torch.device(device):
        torch.manual_seed(cfg["seed"])
        model = Llama(cfg["d_model"], cfg["layers"], cfg["heads"], cfg["d_ff"], cfg["seq_len"], cfg["vocab"],
                      checkpoint=cfg.get("checkpoint", False))
    model.train()
    wl = B.WithLoss(model, cfg["vocab"])
    opt, fused, note = B.build_optimizer(model, route, cfg["lr"], cfg.get("forge_adamw_fused", "auto"))
    cfg["note"] = f"AdamW fused={fused}" + (f" ({note})" if note else "")
    autocast = ((lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)) if device.type == "cuda"
                else contextlib.nullcontext)
    step, _ = B.make_step(route, wl, opt, autocast)
    gen = torch.Generator(device=device).manual_seed(cfg["seed"] + 2)
    loss = None
    for i in range(cfg["warmup"]):
        ts = time.monotonic()
        loss = float(step(*B._device_batch(mb, cfg["seq_len"], cfg["vocab"], device, gen)))
        print(f"[{route}] warm-up step {i + 1}: loss {loss:.4f} ({time.monotonic() - ts:.1f} s)", flush=True)
    x, y = B._device_batch(mb, cfg["seq_len"], cfg["vocab"], device, gen)
    del loss
    mem.sync()
    known = _known_addresses(model, opt, {"batch x": x, "batch y": y})
    mem.reset_peak()
    before = mem.allocated()
    mem.start(cfg["max_entries"])
    try:
        loss = step(x, y)
        mem.sync()
        snap = mem.snapshot()
    finally:
        mem.stop()
    measured = mem.max_allocated()
    dev_index = device.index or 0
    print(f"[{route}] recorded step: loss {float(loss):.4f}, max_memory_allocated {measured / GIB:.3f} GiB, "
          f"{len(snap['device_traces'][dev_index])} trace events", flush=True)
    if cfg.get("save_snapshot"):
        import pickle
        os.makedirs(cfg["save_snapshot"], exist_ok=True)
        with open(os.path.join(cfg["save_snapshot"], f"snapshot_{route}.pickle"), "wb") as f:
            pickle.dump(snap, f)
    an = analyse_snapshot(snap, before, device=dev_index, known=known, inductor_dirs=_inductor_dirs(),
                          top=cfg["top"], measured_peak=measured, max_entries=cfg["max_entries"])
    an.update(route=route, config={k: v for k, v in cfg.items() if k != "result_path"},
              gpu=mem.name(device), torch=torch.__version__, worker_s=time.monotonic() - t0,
              param_bytes=sum(p.nbytes for p in model.parameters()),
              state_bytes=sum(t.nbytes for st in opt.state.values() for t in st.values()
                              if isinstance(t, torch.Tensor)))
    text = render(route, cfg, an)
    with open(os.path.join(cfg["out"], f"profile_memory_{route}.json"), "w") as f:
        json.dump(an, f, indent=1, default=str)
    with open(os.path.join(cfg["out"], f"profile_memory_{route}.md"), "w") as f:
        f.write(text + "\n")
    return text


def worker_main(cfg_path):
    with open(cfg_path) as f:
        cfg = json.load(f)
    try:
        text = run_worker(cfg)
        status = dict(status="ok", text=text)
    except BaseException as e:  # noqa: BLE001  the parent reports it
        traceback.print_exc()
        status = dict(status="error", error=f"{type(e).__name__}: {e}"[-1500:])
    with open(cfg["result_path"], "w") as f:
        json.dump(status, f)
    return 0


# ---------------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default=os.environ.get("OUT", "profile_memory_out"))
    p.add_argument("--routes", default=",".join(B.ROUTES))
    p.add_argument("--mb", type=int, default=8, help="micro-batch (sequences per step)")
    p.add_argument("--quick", action="store_true", help="the --quick model of bench_train_step.py (the default)")
    p.add_argument("--full", action="store_true", help="the full model of bench_train_step.py (8 layers)")
    for k in ("d_model", "layers", "heads", "d_ff", "vocab", "seq_len"):
        p.add_argument("--" + k.replace("_", "-"), type=int)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per decoder layer "
                   "(bench_train_step.py --checkpoint)")
    p.add_argument("--warmup", type=int, default=3, help="steps before the recorded one (the first compiles)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=25, help="live labels listed per route")
    p.add_argument("--max-entries", type=int, default=500_000, help="trace ring buffer size")
    p.add_argument("--forge-adamw-fused", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--run-timeout", type=float, default=240, help="seconds per route subprocess")
    p.add_argument("--time-budget", type=float, default=560, help="routes that would start later are skipped")
    p.add_argument("--save-snapshot", help="also pickle each raw snapshot into this directory (large; not --out)")
    args = p.parse_args(argv)
    preset = B.PRESETS["full" if args.full else "quick"]
    for k in ("d_model", "layers", "heads", "d_ff", "vocab", "seq_len"):
        if getattr(args, k) is None:
            setattr(args, k, preset[k])
    return args


def _tail(path, n):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1])
    args = parse_args(argv)
    routes = [r for r in args.routes.split(",") if r]
    bad = set(routes) - set(B.ROUTES)
    if bad:
        raise SystemExit(f"unknown routes {sorted(bad)}; known: {', '.join(B.ROUTES)}")
    if not torch.cuda.is_available():
        print("profile_memory.py: no CUDA device (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}); it records torch.cuda.memory history and needs a GPU. Nothing was run.",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    logs = tempfile.mkdtemp(prefix="profile_memory_logs_")
    t_start = time.monotonic()
    cfg0 = dict(mb=args.mb, d_model=args.d_model, layers=args.layers, heads=args.heads, d_ff=args.d_ff,
                vocab=args.vocab, seq_len=args.seq_len, warmup=args.warmup, lr=args.lr, seed=args.seed,
                top=args.top, max_entries=args.max_entries, forge_adamw_fused=args.forge_adamw_fused,
                out=os.path.abspath(args.out), save_snapshot=args.save_snapshot, checkpoint=args.checkpoint)
    header = (f"# profile_memory: one steady-state step per route, micro-batch {args.mb}, Llama d_model "
              f"{args.d_model}, {args.layers} layers, d_ff {args.d_ff}, vocab {args.vocab}, seq {args.seq_len}, "
              f"bf16 autocast, fp32 master weights, AdamW; {args.warmup} warm-up steps; torch {torch.__version__}"
              + ("; activation checkpointing per layer" if args.checkpoint else ""))
    print(header, flush=True)
    parts = [header]
    for route in routes:
        left = t_start + args.time_budget - time.monotonic()
        if left < 30:
            parts.append(f"## {route}: skipped ({left:.0f} s left of --time-budget)")
            print(parts[-1], flush=True)
            continue
        cfg = dict(cfg0, route=route, result_path=os.path.join(logs, f"{route}.result.json"))
        cfg_path = os.path.join(logs, f"{route}.config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        log_path = os.path.join(logs, f"{route}.log")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = B.ROOT + os.pathsep + env.get("PYTHONPATH", "")
        t0 = time.monotonic()
        timeout = min(args.run_timeout, left)
        with open(log_path, "w") as logf:
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", cfg_path],
                                    stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
                why = None
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                why = f"killed after {timeout:.0f} s"
        res = None
        if os.path.exists(cfg["result_path"]):
            with open(cfg["result_path"]) as f:
                res = json.load(f)
        wall = time.monotonic() - t0
        if res and res.get("status") == "ok":
            parts.append(res["text"] + f"\n\n({wall:.0f} s)")
        else:
            err = (res or {}).get("error") or why or f"exit code {proc.returncode}, no result"
            parts.append(f"## {route}: FAILED ({wall:.0f} s): {err}\n\nlog tail:\n```\n{_tail(log_path, 2500)}\n```")
        print("\n" + parts[-1], flush=True)
        with open(os.path.join(args.out, "profile_memory.md"), "w") as f:
            f.write("\n\n".join(parts) + "\n")
    print(f"\nwritten: {args.out}/profile_memory.md, profile_memory_<route>.md/.json "
          f"({time.monotonic() - t_start:.0f} s; worker logs in {logs})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
