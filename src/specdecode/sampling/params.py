"""Sampling settings for one request."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..structured.grammar import Grammar

MAX_ABS_BIAS = 100.0  # OpenAI's range for a logit_bias value
MAX_ABS_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token: logit_bias → repetition → frequency → presence penalties → grammar mask →
    temperature → min-p → top-k → top-p, then sample (temperature 0 = greedy: the argmax of the biased, penalised,
    masked logits).

    ``top_k=0``, ``top_p=1.0``, ``min_p=0.0``, penalties 0 (repetition 1.0) and an empty ``logit_bias`` switch
    those warps off; ``seed=None`` draws a fresh seed (reported in the output); ``stop`` holds stop strings, cut
    from the returned text. The penalties count the tokens of each row's own context (``warps``):
    ``presence_penalty`` / ``frequency_penalty`` subtract p·[count > 0] and f·count, count = the token's
    occurrences among the generated tokens; ``repetition_penalty`` r divides a positive logit by r and multiplies a
    negative one by r for every token seen in the prompt or the generated tokens (HF's and vLLM's definitions).
    ``logit_bias`` maps token ids to a value in [−100, 100] added to their logits (stored as sorted pairs);
    ``min_p`` drops tokens whose probability after temperature is below ``min_p`` × the largest. ``grammar`` (a
    ``structured.Grammar``) constrains the output: its mask is part of the target's distribution (logit −∞ where it
    forbids a token).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty}")
        object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(f"grammar must be a specdecode.Grammar or None, got {type(self.grammar).__name__}")

    @property
    def penalised(self) -> bool:
        """True when a warp reads the context (a penalty) or shifts logits (``logit_bias``) before temperature."""
        return bool(
            self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0


def _checked_bias(bias: Mapping[int, float] | tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, value) pairs, each id an integer >= 0 and each value in [−100, 100]."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ValueError(f"logit_bias must map token ids to values, got the entry {pair!r}")
        token, value = pair
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -MAX_ABS_BIAS <= value <= MAX_ABS_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
    tokens = [token for token, _ in pairs]
    if len(set(tokens)) != len(tokens):
        raise ValueError("logit_bias names a token id twice")
    return tuple(sorted((int(token), float(value)) for token, value in pairs))
