from .rule import Rule, get_rule, register_rule

__all__ = ["Rule", "get_rule", "register_rule"]
