from . import cast_after as _cast_after  # noqa: F401  (registers forge::cast_after)
from . import embedding_update as _embedding_update  # noqa: F401  (registers forge::embedding_update(_table)_)
from . import rule_update as _rule_update  # noqa: F401  (registers forge::rule_update_)
from . import wgrad_update_group as _wgrad_update_group  # noqa: F401  (registers forge::wgrad_update_group(_table)_)
from . import wgrad_norm as _wgrad_norm  # noqa: F401  (registers forge::wgrad_sqnorm, embedding_sqnorm, host_scalar)
from . import wgrad_update_q8 as _wgrad_update_q8  # noqa: F401  (registers forge::wgrad_update_q8_)
from .wgrad_update import reference_wgrad_update, wgrad_update

__all__ = ["epilogue_supported", "reference_wgrad_update", "wgrad_update"]


def epilogue_supported(rule) -> tuple[bool, str]:
    """Can the rule be generated as a Triton epilogue? (CPU parameters never need this.)"""
    try:
        from .epilogue_codegen import EpilogueUnsupported, compile_epilogue
    except ImportError as e:  # triton missing
        return False, f"Triton is not available ({e})"
    try:
        compile_epilogue(rule)
    except EpilogueUnsupported as e:
        return False, f"rule {rule.name!r} cannot be fused: {e}"
    return True, ""
