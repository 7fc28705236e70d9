"""forge_compile: FORGE for torch.compile -- linear-layer weight gradients fused with the optimizer update.

Public API:
- ``compile_train_step(fn, dump_dir=None, fuse=True)``: compile a whole ordinary train step;
- ``explain(fn, *args)``: the fusion report for a step, without running it;
- ``FusionReport``; ``optim`` (rules, ``Lion``, ``RuleOptimizer``, ``register_rule``; eager 8-bit-state
  optimizers ``AdamW8bit``, ``Lion8bit``, ``Rule8bitOptimizer``).
The Dynamo route ``torch.compile(model, backend="forge", options={"optimizer": opt})`` is registered
on import and through the ``torch_dynamo_backends`` entry point.
"""
import logging as _logging

from . import optim
from .capture import CompiledTrainStep, ForgeCaptureError, compile_train_step, explain
from .optim.rule import Rule, register_rule
from .optim.translate import UnsupportedOptimizerError
from .report import FusionReport
from .kernels import wgrad_update as _register_fused_op  # noqa: F401  (registers forge::wgrad_update_)
from . import backend as _backend  # noqa: F401  (registers the "forge" Dynamo backend)

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "CompiledTrainStep",
    "ForgeCaptureError",
    "FusionReport",
    "Rule",
    "UnsupportedOptimizerError",
    "compile_train_step",
    "explain",
    "optim",
    "register_rule",
]
__version__ = "0.1.0"
