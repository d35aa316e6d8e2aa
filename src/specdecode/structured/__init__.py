"""Structured output: a grammar (JSON object, JSON schema, regex, Lark, GBNF) as part of the target's distribution."""

from .constraint import Constraint, mask_logits
from .grammar import Grammar

__all__ = ["Constraint", "Grammar", "mask_logits"]
