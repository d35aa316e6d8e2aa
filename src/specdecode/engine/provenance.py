"""What each generated token is: how it was made (an accepted guess or the target's own token), its text in the
answer, and its log-probability under the target.

Sources. A round emits its accepted guesses (depth 1, 2, ... in the round) and then one token of the target's
own: ``recovered`` (drawn after a rejection), ``bonus`` (every guess accepted) or ``plain`` (nothing drafted).

Log-probabilities are the target's own, ``log_softmax(logits)`` of the row that chose the token, before the
request's temperature, top-k and top-p, as OpenAI's API (and vLLM's default) report them: a logprob does not
change with the sampling settings. Each row is reduced on its own, so with a row-invariant runner a token's
logprobs are bitwise the same whether it came from a k-row verify pass or a one-token plain step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

KINDS = ("accepted", "recovered", "bonus", "plain")
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenSource:
    """How one generated token was made: ``kind`` (one of ``KINDS``) and its position in its round (1 = first)."""

    kind: str
    depth: int

    @property
    def source(self) -> str:
        """``draft`` for a guess the target accepted, ``target`` for the target's own token."""
        return "draft" if self.kind == "accepted" else "target"


def round_sources(accepted: int, drafted: bool, rejected: bool) -> list[TokenSource]:
    """The sources of one round's tokens: ``accepted`` guesses, then the target's token (recovered after a
    rejection, bonus after a full acceptance, plain when the round drafted nothing)."""
    last = "plain" if not drafted else "recovered" if rejected else "bonus"
    return [TokenSource("accepted", d + 1) for d in range(accepted)] + [TokenSource(last, accepted + 1)]


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of an emitted token and its ``top`` most likely alternatives (id, logprob),
    most likely first (ties: lower id first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(rows: torch.Tensor, tokens: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """``log_softmax`` of each logits row ``rows[i]`` (``[n, V]``), at ``tokens[i]``, and its ``top`` best."""
    out = []
    for row, token in zip(rows, tokens, strict=True):
        logprobs = torch.log_softmax(row.float(), dim=-1)  # one row at a time: the same bits in any pass
        best: tuple[tuple[int, float], ...] = ()
        if top:
            order = torch.sort(logprobs, descending=True, stable=True).indices[:top]
            best = tuple((int(i), float(logprobs[i])) for i in order)
        out.append(TokenLogprob(int(token), float(logprobs[token]), best))
    return out


class Detokenizer:
    """Each token's piece of the answer's text, incrementally: the pieces concatenate to ``decode(ids)``.

    A piece is what the token adds to the decoded text of a short window of earlier tokens (tokenizers decode
    a token differently at the start of a text). A token that ends inside a multi-byte character (decoding
    to U+FFFD) gets an empty piece; the token that completes the character gets all of it.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._start = 0  # the window: ids[_start:_read] decode to _prefix
        self._read = 0
        self._prefix = ""

    def peek(self, token: int) -> str:
        """The piece ``token`` would add next (without adding it)."""
        text = self._decode(self.ids[self._start :] + [int(token)])
        return text[len(self._prefix) :] if len(text) > len(self._prefix) and not text.endswith("\ufffd") else ""

    def push(self, token: int) -> str:
        """Add ``token``; return its piece."""
        self.ids.append(int(token))
        text = self._decode(self.ids[self._start :])
        if len(text) <= len(self._prefix) or text.endswith("\ufffd"):
            return ""
        piece = text[len(self._prefix) :]
        self._start, self._read = self._read, len(self.ids)
        self._prefix = self._decode(self.ids[self._start : self._read])
        return piece


def fit_pieces(pieces: Sequence[str], text: str) -> list[str]:
    """``pieces`` cut (or the last one completed) so that they concatenate to ``text``: the answer's final text
    drops a matched stop string, and may end in a character whose last bytes no token completed."""
    out, offset = [], 0
    for piece in pieces:
        fitted = text[offset : offset + len(piece)]
        offset += len(fitted)
        out.append(fitted)
    if out and offset < len(text):
        out[-1] += text[offset:]
    return out


def token_pieces(decode: Callable[[list[int]], str], token_ids: Sequence[int], text: str) -> list[str]:
    """Each token's piece of ``text``, the answer decoded from ``token_ids`` (``Detokenizer``, ``fit_pieces``)."""
    detok = Detokenizer(decode)
    return fit_pieces([detok.push(t) for t in token_ids], text)
