from .wgrad_update_pattern import FusionDecision, rewrite_wgrad_updates

__all__ = ["FusionDecision", "rewrite_wgrad_updates"]
