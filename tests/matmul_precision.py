"""torch's TF32 switch for fp32 matmuls, set for a block and restored after it (shared by the tests)."""
import contextlib

import torch


@contextlib.contextmanager
def tf32(on: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
