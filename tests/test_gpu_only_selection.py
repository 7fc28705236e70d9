"""tests/conftest.py's FORGE_GPU_ONLY=1 (benchmarks/gpu_session.sh CPU_TESTS=0): tests that touch no CUDA are
skipped with a reason, tests named or parametrized for CUDA are kept (here, without a GPU, they skip for that)."""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET


def test_gpu_only_skips_cpu_tests_keeps_cuda_ones(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    xml = tmp_path / "r.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                    os.path.join(here, "test_stochastic_round_step.py"), "-k", "embedding_is_the_spec"],
                   capture_output=True, text=True, env={**os.environ, "FORGE_GPU_ONLY": "1"}, cwd=here, check=False)
    why = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        skip = case.find("skipped")
        why[case.get("name")] = "" if skip is None else skip.get("message", "")
    assert set(why) == {f"test_fused_bf16_embedding_is_the_spec[{d}-{r}]" for d in ("cpu", "cuda")
                        for r in ("step", "backend")}, why
    for name, msg in why.items():
        # CPU items skipped by the option; CUDA items kept (without a GPU their own skipif skips them)
        assert ("FORGE_GPU_ONLY" in msg) == ("[cpu-" in name), (name, msg)
