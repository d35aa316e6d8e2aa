"""Collects generated tokens, honouring EOS, stop strings and max_new_tokens token by token."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable


class OutputSink:
    """Generated tokens and text of one request; ``push`` stops exactly at the first stop condition.

    A stop string may span tokens; the returned text ends before it. Streaming (``take_delta``) holds back
    text that could still become a stop string and a trailing partial UTF-8 character (U+FFFD).
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        eos_ids: Iterable[int],
        max_new_tokens: int,
        stop: tuple[str, ...] = (),
    ) -> None:
        self._decode = decode
        self._eos = frozenset(eos_ids)
        self._max_new_tokens = max_new_tokens
        self._stop = stop
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._text = ""
        self._text_len_tokens = 0
        self._cut: int | None = None
        self._emitted = 0

    @property
    def remaining(self) -> int:
        """Tokens still allowed by max_new_tokens."""
        return self._max_new_tokens - len(self.token_ids)

    def push(self, tokens: Iterable[int]) -> int:
        """Append tokens until one ends generation; return how many were taken."""
        taken = 0
        for token in tokens:
            if self.finish_reason is not None:
                break
            self.token_ids.append(int(token))
            taken += 1
            if token in self._eos:
                self.finish_reason = "eos"
            elif self._stop and self._completes_stop():
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self._max_new_tokens:
                self.finish_reason = "length"
        return taken

    def _completes_stop(self) -> bool:
        old = self._text  # the text before the newest token: it holds no stop string
        text = self._refresh()
        stable = len(old) if text.startswith(old) else len(os.path.commonprefix([old, text]))
        start = max(0, stable - max(map(len, self._stop)) + 1)
        hits = [i for s in self._stop if (i := text.find(s, start)) >= 0]
        if hits:
            self._cut = min(hits)
        return bool(hits)

    def _refresh(self) -> str:
        if self._text_len_tokens != len(self.token_ids):
            self._text = self._decode(self.token_ids)
            self._text_len_tokens = len(self.token_ids)
        return self._text

    def text_so_far(self) -> str:
        """Decoded text of the tokens taken so far (cached; ends before a matched stop string)."""
        text = self._refresh()
        return text if self._cut is None else text[: self._cut]

    @property
    def text(self) -> str:
        """The final text: everything generated, without a matched stop string."""
        return self.text_so_far()

    def take_delta(self) -> str:
        """Text that is now certain and was not returned before (for streaming)."""
        text = self.text_so_far()
        end = len(text)
        if self.finish_reason is None:
            end = len(text.rstrip("\ufffd"))
            head = text[:end]
            end -= max((n for s in self._stop for n in range(1, len(s)) if head.endswith(s[:n])), default=0)
        delta = text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta
