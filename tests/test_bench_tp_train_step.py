"""benchmarks/bench_tp_train_step.py: one CPU smoke run of main() over 2 gloo ranks (tiny shapes): the plan
parallelises examples/train_lm.py's Llama, both routes train the same batches to the same losses, and forge fuses
every sharded linear weight. Timings mean nothing here; the GPU run is the benchmark."""
import json
import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def test_cpu_smoke_run_of_main(tmp_path, capsys):
    import bench_tp_train_step as bench

    out = tmp_path / "tp.json"
    bench.main(["--device", "cpu", "--tiny", "--routes", "baseline,step", "--mbs", "1,2", "--check-steps", "2",
                "--warmup", "0", "--iters", "1", "--out", str(out)])
    text = capsys.readouterr().out
    res = json.loads(out.read_text())["results"]
    assert [r["mb"] for r in res["baseline"]["runs"]] == [1, 2] and all("ms" in r for r in res["step"]["runs"]), res
    # the same model, batches and plan: the first loss (before any update) equal, the second within bf16's reach
    lb, ls = res["baseline"]["losses"], res["step"]["losses"]
    assert lb[0] == pytest.approx(ls[0], rel=1e-3) and abs(lb[1] - ls[1]) < 2e-2, (lb, ls)
    # 2 layers x (q, k, v, o, gate, up, down) + the column-wise lm_head; the row-wise embedding stays unfused
    assert res["step"]["report"]["fused"] == 15, res["step"]["report"]
    assert [n for n, _ in res["step"]["report"]["unfused"]] == ["fwd.model.embed.weight"], res["step"]["report"]
    assert "loss check" in text and "FAIL" not in text, text
