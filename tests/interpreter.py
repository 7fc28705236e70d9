"""Tests that run Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported (triton.language's own @jit helpers such as tl.cdiv are
bound at import), and setting it for a whole session would interpret CUDA tests too. So a test file's tests whose
names contain "interpreter" take the ``interpret`` fixture (conftest.py) and run in a child pytest with the
variable set, started by the file's ``test_interpreter_tests_in_subprocess`` (``run_child``), unless this session
already interprets.
"""
import os
import subprocess
import sys

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def run_child(path: str, timeout: float = 600) -> None:
    """Run ``path``'s interpreter tests in a child pytest with TRITON_INTERPRET=1 and FORGE_TRITON_CPU=1."""
    if INTERPRETING:
        pytest.skip("this session interprets: the interpreter tests run directly")
    import numpy as np

    if tuple(int(v) for v in np.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip(f"triton 3.6's interpreter breaks with numpy>=2.4 (found {np.__version__})")
    env = dict(os.environ, TRITON_INTERPRET="1", FORGE_TRITON_CPU="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, "-k", "interpreter"],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
