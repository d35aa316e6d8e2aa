"""Per-token extras of a response: each token's source (``include_sources``) and logprobs, in OpenAI's shapes.

``TokenTrack`` gives every generated token its piece of the answer's text (``provenance.Detokenizer``) and
releases a token's record only once the streamed text has reached the end of its piece, so a chunk's records
describe the text sent so far; at the end, the pieces are cut or completed to concatenate to the final text
(a matched stop string is not part of it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...engine.provenance import Detokenizer, TokenLogprob, TokenSource, fit_pieces

LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for log(0)


@dataclass(frozen=True)
class TokenRecord:
    """One generated token as the API reports it: id, text piece, source and (if asked) logprobs, with the
    alternatives' texts."""

    token: int
    text: str
    source: TokenSource
    logprob: TokenLogprob | None = None
    alternatives: tuple[tuple[str, float], ...] = ()


class TokenTrack:
    """The records of one response's tokens, in step with its text."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._detok = Detokenizer(decode)
        self._records: list[TokenRecord] = []
        self._ends: list[int] = []  # the text offset where each record's piece ends
        self._taken = 0

    def add(
        self, token_ids: Sequence[int], sources: Sequence[TokenSource], logprobs: Sequence[TokenLogprob] | None
    ) -> None:
        """Record newly generated tokens."""
        for i, (token, source) in enumerate(zip(token_ids, sources, strict=True)):
            logprob = None if logprobs is None else logprobs[i]
            alternatives = () if logprob is None else tuple((self._detok.peek(t), lp) for t, lp in logprob.top)
            text = self._detok.push(token)
            self._records.append(TokenRecord(int(token), text, source, logprob, alternatives))
            self._ends.append((self._ends[-1] if self._ends else 0) + len(text))

    def take(self, text_length: int) -> list[TokenRecord]:
        """The records not taken yet whose pieces end within the first ``text_length`` characters sent."""
        start = self._taken
        while self._taken < len(self._records) and self._ends[self._taken] <= text_length:
            self._taken += 1
        return self._records[start : self._taken]

    def finish(self, text: str) -> list[TokenRecord]:
        """Every record not taken yet, the pieces fitted to end the answer's final ``text`` (``fit_pieces``)."""
        rest = self._records[self._taken :]
        offset = self._ends[self._taken - 1] if self._taken else 0
        self._taken = len(self._records)
        pieces = fit_pieces([r.text for r in rest], text[offset:])
        return [dataclasses.replace(record, text=piece) for record, piece in zip(rest, pieces, strict=True)]


def sources_json(records: Sequence[TokenRecord]) -> list[dict[str, Any]]:
    """``[{"token", "text", "source", "kind", "depth"}]``: source ``draft`` (an accepted guess at ``depth`` in
    its round) or ``target`` (kind ``recovered``, ``bonus`` or ``plain``)."""
    return [
        {
            "token": r.token,
            "text": r.text,
            "source": r.source.source,
            "kind": r.source.kind,
            "depth": r.source.depth,
        }
        for r in records
    ]


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs_json(records: Sequence[TokenRecord]) -> dict[str, Any]:
    """Chat completions' ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}], ...}``."""
    content = [
        {
            "token": r.text,
            "logprob": _logprob(r.logprob.logprob),
            "bytes": list(r.text.encode()),
            "top_logprobs": [
                {"token": text, "logprob": _logprob(lp), "bytes": list(text.encode())} for text, lp in r.alternatives
            ],
        }
        for r in records
        if r.logprob is not None
    ]
    return {"content": content, "refusal": None}


def completion_logprobs_json(records: Sequence[TokenRecord], text_offset: int) -> dict[str, Any]:
    """Completions' ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (text → logprob) and
    ``text_offset`` (each token's start in the answer, counting from ``text_offset``)."""
    offsets = []
    for r in records:
        offsets.append(text_offset)
        text_offset += len(r.text)
    return {
        "tokens": [r.text for r in records],
        "token_logprobs": [_logprob(r.logprob.logprob) for r in records],
        "top_logprobs": [{text: _logprob(lp) for text, lp in r.alternatives} for r in records],
        "text_offset": offsets,
    }
