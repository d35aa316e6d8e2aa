"""Which training rows guess an answer token: drafting only ever guesses the assistant's tokens.

A chat's token ids hold the system prompt, the user's turns and the assistant's; a head drafts only inside
assistant turns. Row t of a training sequence (the head reading f_t and token t+1) guesses the token at t+2, so
it is an *answer row* when position t+2 lies in an assistant turn: after the template's assistant header, up to
and including the id that ends the turn (which the target writes, so a head drafts it too). A chat cut off before
its first answer (a long prompt) has no answer rows; a sequence with neither an assistant header nor a turn-ending
id (a plain text) is all answer rows: every row is one a head could draft at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..models.loaded import LoadedModel

_PROBE = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]


@dataclass(frozen=True)
class AnswerMarkers:
    """How the target's chat template opens an assistant turn (``header`` ids), the id that ends it, and the special
    ids only a chat holds (the end's and the header's), which tell a chat cut off in its prompt from a text."""

    header: tuple[int, ...]
    end: int
    chat_ids: frozenset[int] = frozenset()


def answer_markers(target: LoadedModel) -> AnswerMarkers | None:
    """The assistant header and turn-ending id of ``target``'s chat template, read off a probe chat: the header
    is what the generation prompt appends to the user turn, the end the first special id (not the unknown token's)
    after it. None when the model has no template or the template does not render that way (then every row
    counts)."""
    if not target.has_chat_template:
        return None
    try:
        user = target.chat_ids(_PROBE[:1], generation_prompt=False)
        prompt = target.chat_ids(_PROBE[:1])
        full = target.chat_ids(_PROBE, generation_prompt=False)
    except ValueError:  # a template that refuses the probe chat: no markers, every row counts
        return None
    tokenizer = target.tokenizer
    header = prompt[len(user) :]
    if not header or prompt[: len(user)] != user or full[: len(prompt)] != prompt:
        return None
    special = _special_ids(tokenizer) - {getattr(tokenizer, "unk_token_id", None)}
    ends = [t for t in full[len(prompt) :] if t in special]
    if not ends:
        return None
    return AnswerMarkers(tuple(header), ends[0], frozenset({ends[0], *(t for t in header if t in special)}))


def _special_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special ids: its named ones and every added token marked special (a tokenizer converted
    from a GGUF by transformers 5.17 names only <|im_start|> and <|endoftext|>, though <|im_end|> is special)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ids | {int(i) for i, token in added.items() if getattr(token, "special", False)}


def answer_positions(ids: Sequence[int], markers: AnswerMarkers | None) -> torch.Tensor:
    """bool [len(ids)]: the positions inside assistant turns (the header excluded, the ending id included); all
    True for a plain text (no header and no ending id in it) or without markers. A turn cut off by the sequence's
    end runs to it."""
    n = len(ids)
    if markers is None:
        return torch.ones(n, dtype=torch.bool)
    inside = torch.zeros(n, dtype=torch.bool)
    header, width = list(markers.header), len(markers.header)
    found = False
    t = 0
    while t + width <= n:
        if list(ids[t : t + width]) != header:
            t += 1
            continue
        found = True
        start = end = t + width
        while end < n and ids[end] != markers.end:
            end += 1
        inside[start : min(end + 1, n)] = True
        t = end + 1
    is_chat = found or markers.end in ids or any(t in markers.chat_ids for t in ids)
    return inside if is_chat else torch.ones(n, dtype=torch.bool)


def answer_rows(ids: Sequence[int], markers: AnswerMarkers | None) -> torch.Tensor:
    """bool [len(ids)]: rows t whose guess, the token at t+2, is an answer token (a row past the text guesses
    what follows its last position, which counts as that position does)."""
    inside = answer_positions(ids, markers)
    if inside.numel() == 0:
        return inside
    return torch.cat([inside[2:], inside[-1:].expand(min(2, inside.numel()))])
