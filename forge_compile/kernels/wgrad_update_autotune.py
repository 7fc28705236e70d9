"""Autotuning of the fused wgrad+update kernel, keyed on the weight shape and the token-count bucket.

The default configurations (``pick_config``, ``pick_gconfig``) are tables from H200 sweeps; another GPU, shape or
rule may want another one. With ``FORGE_AUTOTUNE=1`` the first launch of each key -- (rule, N, K, bucket of M,
activation dtype, stored dW or not, device, triton version) -- times every candidate configuration of the
kernels that may run it (the Gluon kernel where ``use_gluon`` allows it, the Triton kernel's configs) and keeps
the fastest; later launches of the key take it without timing. M enters as its power-of-two bucket and the
step counter and hyper-parameters are tensors read on the host (``host_scalars``), so a new batch size within a
bucket, a new step or a new learning rate never re-tunes. Choices persist in a JSON file
(``FORGE_AUTOTUNE_CACHE``, default ``<kernel cache>/autotune.json``), so a new process does not re-tune either.

Tuning never touches the real parameter or its states: candidates run on scratch copies (of at most
``FORGE_AUTOTUNE_MIB`` MiB, default 1024: a taller weight is tuned on its first rows, which have the same
per-tile work; the persistent Gluon grid then sees fewer tiles per SM than the real launch) with the real
activations (read only). Off by default: tuning costs the first step a few hundred milliseconds per new key and
that scratch memory, and every candidate is exact (the epilogue math is the same in all of them), so the choice
changes speed only.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
from typing import Any, Callable

import torch

from ..optim.rule import Rule

log = logging.getLogger(__name__)

__all__ = ["ENV", "enabled", "m_bucket", "tune_key", "choose", "forget", "Choice", "clear", "counters"]

ENV = "FORGE_AUTOTUNE"
counters: collections.Counter = collections.Counter()
_LOCK = threading.Lock()
_TABLE: dict[str, "Choice"] = {}
_LOADED: list[str] = []    # the cache file the table was loaded from
_FORGOTTEN: set[str] = set()   # keys whose choice failed in this process: never re-tuned here


@dataclasses.dataclass(frozen=True)
class Choice:
    family: str      # "gluon" | "triton"
    config: Any      # a GConfig (gluon) or a CONFIGS name (triton)
    ms: float = float("nan")   # its measured time at tuning (information only)

    def to_json(self) -> dict:
        cfg = dataclasses.asdict(self.config) if self.family == "gluon" else self.config
        return {"family": self.family, "config": cfg, "ms": self.ms}

    @staticmethod
    def from_json(d: dict) -> "Choice":
        if d["family"] == "gluon":
            from .wgrad_update_gluon import GConfig

            return Choice("gluon", GConfig(**d["config"]), d.get("ms", float("nan")))
        return Choice("triton", str(d["config"]), d.get("ms", float("nan")))


def enabled() -> bool:
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "on", "yes")


def m_bucket(m: int) -> int:
    """Next power of two >= m (at least 64): launches of one bucket share a choice."""
    b = 64
    while b < m:
        b *= 2
    return b


def _n_tensor_states(rule: Rule, states, table) -> int:
    from .wgrad_update_triton import split_states

    return len(split_states(rule, states, table)[0])


def tune_key(rule: Rule, weight, dy_t, x, states, side_out, table=None) -> str:
    """The key of a launch's choice; a launch reading a scalar table shares the key (and the choice) of the same
    launch with host scalars."""
    import triton

    n, k = weight.shape
    n_ts = _n_tensor_states(rule, states, table)
    dev = torch.cuda.get_device_name(weight.device) if weight.is_cuda else str(weight.device)
    from .wgrad_update_triton import SIDE_CAST, fp32_dot_precision, side_mode

    # the fp32 dot's precision: IEEE and TF32 launches are different kernels with different winners
    prec = fp32_dot_precision(dy_t, x)
    # the side output: none / dW (False / True, the keys' spelling before the cast copy existed) / "cast"
    side = "cast" if side_mode(side_out) == SIDE_CAST else side_out is not None
    return "|".join(map(str, (rule.name, n, k, m_bucket(x.shape[0]), str(dy_t.dtype), str(x.dtype), n_ts,
                              side, dev, triton.__version__) + ((prec,) if prec else ())))


def _cache_file() -> str:
    f = os.environ.get("FORGE_AUTOTUNE_CACHE")
    if f:
        return f
    from .epilogue_codegen import _cache_dir

    return os.path.join(_cache_dir(), "autotune.json")


def _load() -> None:
    path = _cache_file()
    if _LOADED and _LOADED[0] == path:
        return
    table = {}
    try:
        with open(path) as fh:
            for key, d in json.load(fh).items():
                table[key] = Choice.from_json(d)
    except FileNotFoundError:
        pass
    except Exception as e:  # a corrupt or foreign file: re-tune rather than fail the step
        log.warning("forge: autotune cache %s unreadable (%s: %s); tuning afresh", path, type(e).__name__, e)
    with _LOCK:
        _TABLE.update(table)
        _LOADED[:] = [path]


def _save() -> None:
    path = _cache_file()
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with _LOCK:
            data = {k: c.to_json() for k, c in _TABLE.items()}
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache dir only costs re-tuning in the next process
        log.warning("forge: autotune cache %s not written: %s", path, e)


def clear(memory_only: bool = False) -> None:
    with _LOCK:
        _TABLE.clear()
        _LOADED.clear()
        _FORGOTTEN.clear()
    counters.clear()
    if not memory_only:
        try:
            os.remove(_cache_file())
        except OSError:
            pass


# ----------------------------------------------------------------------------------------------------
# candidates and timing


def candidates(rule: Rule, weight, dy_t, x, states, side_out, table=None) -> list[Choice]:
    from . import wgrad_update_gluon as wg
    from . import wgrad_update_triton as wt

    n, k = weight.shape
    m = x.shape[0]
    out = []
    if wg.use_gluon(weight, dy_t, x, states, rule, side_out, table):
        if wt.side_mode(side_out) == wt.SIDE_CAST:
            # only pointer epilogues write the cast copy: the pick for it, then the other pointer candidates
            n_load = 1 + _n_tensor_states(rule, states, table)
            cands = [wg.pick_for(m, n_load, x.element_size(), wt.SIDE_CAST)]
            cands += [c for c in wg.gconfig_candidates(m, n_load, x.element_size()) if c.epi in wg.POINTER_EPIS]
            out += [Choice("gluon", c) for c in dict.fromkeys(cands)]
        else:
            out += [Choice("gluon", c) for c in wg.gconfig_candidates(m, _n_arrays(rule, states, side_out, table),
                                                                       x.element_size())]
    prec = wt.fp32_dot_precision(dy_t, x)
    names = wt.tune_candidates(n, k, m, prec != "", prec == "tf32")
    # beside the Gluon kernel only the Triton table's own pick: the other configs lost to both at every point
    # measured (RESULTS.md runs 6-7) and each costs a compile at tuning
    out += [Choice("triton", name) for name in (names[:1] if out else names)]
    return out


def _n_arrays(rule: Rule, states, side_out, table=None) -> int:
    # [N, K] arrays a launch reads or writes: W, the tensor states, the side output (dW, or W's cast copy)
    return 1 + _n_tensor_states(rule, states, table) + (side_out is not None)


def _scratch_rows(rule: Rule, weight, states, side_out, table=None) -> int:
    n, k = weight.shape
    n_arrays = _n_arrays(rule, states, side_out, table)
    cap = int(float(os.environ.get("FORGE_AUTOTUNE_MIB", "1024")) * 2**20)
    rows = cap // max(1, n_arrays * k * 4)
    if rows >= n:
        return n
    return max(128, rows // 128 * 128)


def _bind_choice(choice: Choice, weight, dy_t, x, states, hparams, rule, side_out, table=None) -> Callable[[], None]:
    # the candidate's kernel alone, its host part (argument checks, descriptors, host scalars) done once: what a
    # training step pays per launch is the kernel (memoized or graphed launches), and timing the whole Python
    # launch picked host-bound configs -- on the H200 the Gluon path's unmemoized launch (~0.2 ms of host) lost to
    # Triton's at 2048x2048, where its kernel is 17-30 % faster (stop 24, NOTES_kernel.md)
    if choice.family == "gluon":
        from .wgrad_update_gluon import bound_launch
    else:
        from .wgrad_update_triton import bound_launch
    return bound_launch(weight, dy_t, x, states, hparams, rule, side_out, config=choice.config, table=table)


def _time_ms(fn: Callable[[], None]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20, return_mode="median")


def _tune(rule: Rule, weight, dy_t, x, states, hparams, side_out, cands: list[Choice], table=None) -> Choice | None:
    rows = _scratch_rows(rule, weight, states, side_out, table)
    scalar = (lambda i: False) if table is not None else rule.is_scalar_state   # a table launch: tensor states only
    with torch.no_grad():
        w_s = weight[:rows].clone()
        st_s = [s.clone() if scalar(i) else s[:rows].clone() for i, s in enumerate(states)]
        g_s = None if side_out is None else torch.empty_like(w_s, dtype=side_out.dtype)
        # dY [M, N] row-major sliced to its first `rows` columns, contiguous again (TMA needs it), as dy_t
        dy_s = dy_t[:rows] if rows == weight.shape[0] else dy_t[:rows].t().contiguous().t()
    scalar0 = [s.clone() for i, s in enumerate(st_s) if scalar(i)]
    timed, default = [], None
    for c in cands:
        try:
            fn = _bind_choice(c, w_s, dy_s, x, st_s, hparams, rule, g_s, table)

            def run(fn=fn):
                fn()
                # scalar states back to their value: every candidate and repetition sees the same host scalars
                for s, s0 in zip((s for i, s in enumerate(st_s) if scalar(i)), scalar0):
                    s.copy_(s0)
            ms = _time_ms(run)
        except Exception as e:  # a config that does not fit this shape/GPU (shared memory, registers)
            log.debug("forge: autotune candidate %s failed: %s: %s", c, type(e).__name__, str(e)[:200])
            counters["candidate_failed"] += 1
            continue
        counters["candidates_timed"] += 1
        timed.append(dataclasses.replace(c, ms=ms))
        if c is cands[0]:
            default = timed[-1]
    del w_s, st_s, g_s, dy_s
    if not timed:
        return None
    best = min(timed, key=lambda c: c.ms)
    # the default (the first candidate, when it ran) stays unless another beats it by more than the timing noise:
    # a choice within a few percent is a coin toss that a tuned run should not lose to the untuned one on
    if default is not None and best.ms > default.ms * (1 - KEEP_DEFAULT):
        counters["kept_default"] += 1
        return default
    return best


# how much faster than the default a candidate must time to replace it (do_bench medians of one kernel moved by
# 1-3 % between runs on the same H100, stop 24)
KEEP_DEFAULT = 0.03


def forget(weight, dy_t, x, states, rule: Rule, side_out=None, *, why: BaseException | None = None,
           table=None) -> None:
    """Drop this launch's choice (it failed to build or launch): the key goes back to the untuned path for the
    rest of the process and is re-tuned in the next one."""
    key = tune_key(rule, weight, dy_t, x, states, side_out, table)
    with _LOCK:
        dropped = _TABLE.pop(key, None)
    counters["forgotten"] += 1
    _FORGOTTEN.add(key)
    log.warning("forge: autotuned choice %s for %s failed (%s); using the default configuration",
                dropped, key, why)
    _save()


def _device_ok(weight) -> bool:
    return weight.is_cuda


def choose(weight, dy_t, x, states, hparams, rule: Rule, side_out=None, table=None) -> Choice | None:
    """The tuned choice for this launch (tuning it now if the key is new); None when tuning is off, the launch
    is not on a CUDA device, or no candidate ran. ``table``: the launch reads its scalars from this row
    (``states`` are its tensor states; candidates are timed reading it too)."""
    if not enabled() or not _device_ok(weight) or x.shape[0] == 0:
        return None
    _load()
    key = tune_key(rule, weight, dy_t, x, states, side_out, table)
    if key in _FORGOTTEN:
        return None
    hit = _TABLE.get(key)
    if hit is not None:
        counters["hit"] += 1
        return hit
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None   # timing (events, synchronize) cannot run inside a CUDA graph capture: untuned there
    cands = candidates(rule, weight, dy_t, x, states, side_out, table)
    if len(cands) <= 1:
        choice = cands[0] if cands else None
    else:
        choice = _tune(rule, weight, dy_t, x, states, hparams, side_out, cands, table)
        counters["tuned"] += 1
        log.info("forge: autotuned %s -> %s %s (%.4f ms on %d candidates)", key,
                 choice.family if choice else None, choice.config if choice else None,
                 choice.ms if choice else float("nan"), len(cands))
    if choice is not None:
        with _LOCK:
            _TABLE[key] = choice
        _save()
    return choice
