"""Probe (stop 23): why the C++ wrapper's step differed from the Python wrapper's on CUDA under torch 2.11.
Trains a small MLP three AdamW steps through each route (ROUTES, default "step,backend") with the Python and the C++
wrapper; logs every forge op call's arguments in both, the per-parameter differences after each step, and tars the
C++ sources into $OUT. Found: only the step route, only the unfused biases, from the second step on (3.4e-3): the
C++ wrapper handed a Triton kernel the host pointer of torch.optim's CPU step counter (now declined in capture.py).
Usage (device tool): EXTRA="python3 benchmarks/diag_cpp_wrapper.py" TESTS=0 BENCH=0 bash benchmarks/gpu_session.sh;
DEV=cpu runs it here."""
import os, sys, json, shutil, tempfile
import torch, torch.nn as nn
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import importlib
wu = importlib.import_module("forge_compile.kernels.wgrad_update")
import forge_compile.kernels.launch_memo as lm
from models import mse_route_step

DEV = os.environ.get("DEV", "cuda")
TAG = os.environ.get("TAG", "")
OUT = os.environ.get("OUT", "/tmp/out")
LOG = []
real = wu.wgrad_update


def spy(weight, dy_t, x, states, hparams, rule, cast_out=None, emb=None):
    def d(t):
        if not isinstance(t, torch.Tensor):
            return repr(t)
        return dict(shape=list(t.shape), stride=list(t.stride()), dtype=str(t.dtype), 
                    sum=float(t.double().sum()) if t.numel() else 0.0, off=t.storage_offset(), contig=t.is_contiguous())
    LOG.append(dict(weight=d(weight), dy_t=d(dy_t), x=d(x), states=[d(s) for s in states],
                    hparams=[h.tolist() if isinstance(h, torch.Tensor) else repr(h) for h in hparams], rule=rule,
                    cast_out=d(cast_out) if cast_out is not None else None))
    return real(weight, dy_t, x, states, hparams, rule, cast_out=cast_out, emb=emb)


wu.wgrad_update = spy


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 8)).to(DEV)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g).to(DEV), torch.randn(16, 8, generator=g).to(DEV)) for _ in range(3)]


def train(route, cpp, memo=True, tag=""):
    torch._dynamo.reset()
    lm.ENABLED[0] = memo
    LOG.clear()
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    step = mse_route_step(route, m, opt, {"cpp_wrapper": True} if cpp else {})
    res = []
    for x, y in batches():
        loss = step(x, y).item()
        res.append(dict(loss=loss, params=[p.detach().clone() for p in m.parameters()],
                        states=[{k: v.detach().clone() for k, v in opt.state[p].items()} for p in m.parameters()]))
    calls = list(LOG)
    return res, calls


results = {}
print("deterministic", __import__("torch._inductor.config", fromlist=["x"]).deterministic, flush=True)
for route in os.environ.get("ROUTES", "step,backend").split(","):
    cache = tempfile.mkdtemp()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    py, py_calls = train(route, False)
    cache2 = tempfile.mkdtemp()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache2
    cpp, cpp_calls = train(route, True)
    for f in __import__("pathlib").Path(cache2).rglob("*.cpp"):
        os.makedirs("/tmp/diagsrc", exist_ok=True); shutil.copy(f, f"/tmp/diagsrc/{TAG}{route}_{f.name}")
    cpp_nomemo = cpp
    if os.environ.get("NOMEMO") == "1":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
        cpp_nomemo, _ = train(route, True, memo=False)
    r = dict(losses_py=[s["loss"] for s in py], losses_cpp=[s["loss"] for s in cpp],
             losses_cpp_nomemo=[s["loss"] for s in cpp_nomemo])
    r["param_maxdiff_per_step"] = [[float((a - b).abs().max()) for a, b in zip(s1["params"], s2["params"])]
                                   for s1, s2 in zip(py, cpp)]
    r["state_maxdiff_step0"] = [{k: float((v - s2[k]).abs().max()) for k, v in s1.items() if isinstance(v, torch.Tensor)}
                                for s1, s2 in zip(py[0]["states"], cpp[0]["states"])]
    r["n_calls"] = [len(py_calls), len(cpp_calls)]
    r["calls_py"] = py_calls[:6]
    r["calls_cpp"] = cpp_calls[:6]
    results[route] = r
    print(route, json.dumps({k: r[k] for k in ("losses_py", "losses_cpp", "losses_cpp_nomemo", "param_maxdiff_per_step", "n_calls")}), flush=True)
    for a, b in zip(py_calls[:6], cpp_calls[:6]):
        for k in a:
            if a[k] != b[k]:
                print("  DIFF", k, "py", a[k], "cpp", b[k], flush=True)
json.dump(results, open(os.path.join(OUT, f"{TAG}diag.json"), "w"), indent=1, default=str)
os.system(f"tar czf {OUT}/{TAG}src.tgz -C /tmp diagsrc")
