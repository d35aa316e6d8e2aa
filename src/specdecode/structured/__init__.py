"""Structured output: a grammar (JSON object, JSON schema, regex, Lark, GBNF) as part of the target's distribution."""

from .constraint import Constraint, cut_at_forbidden, mask_logits, with_forced
from .grammar import Grammar

__all__ = ["Constraint", "Grammar", "cut_at_forbidden", "mask_logits", "with_forced"]
