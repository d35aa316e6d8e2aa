"""Training samples as token windows of at most ``max_length``: nothing a sample holds is lost to the cut.

A text is cut into consecutive windows. A chat that fits is one window, its template rendered whole. A longer chat
is split into *exchanges* (a user turn and the answers that follow it) and each window is a chat of its own: the
chat's system message (if any), then whole exchanges in order, as many as fit, so every window opens as a chat
does and its answers are read after their questions. An exchange that alone passes ``max_length`` keeps the end of
its question (its last ``max_length // 2`` tokens) and as much of its answer as fits: cut from the end as before,
a long prompt left no answer rows at all (5 of the 32 held-out chats at 1,024 tokens). Every answer is in exactly
one window.
"""

from __future__ import annotations

from typing import Any

from ..models.loaded import LoadedModel
from .data import Message, Sample


def token_windows(target: LoadedModel, sample: Sample, max_length: int) -> list[list[int]]:
    """``sample``'s token ids in windows of at most ``max_length`` tokens (see the module docstring); a chat is
    rendered by ``target.chat_ids`` (without a chat template: its turns' text joined by newlines, cut to
    ``max_length``)."""
    if isinstance(sample, str):
        ids = [int(t) for t in target.tokenizer(sample, add_special_tokens=True, verbose=False)["input_ids"]]
        return [ids[start : start + max_length] for start in range(0, len(ids), max_length)] or [[]]
    ids = target.chat_ids(sample, generation_prompt=False)
    if not target.has_chat_template:
        return [ids[:max_length]]
    if len(ids) <= max_length:
        return [ids]
    return chat_windows(target, sample, max_length)


def exchanges(messages: list[Message]) -> tuple[list[Message], list[list[Message]]]:
    """(the leading system message, if any; the rest in exchanges): a new exchange starts at each user turn that
    follows an answer (consecutive user turns, or answers, stay together)."""
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    groups: list[list[Message]] = []
    for message in messages[len(system) :]:
        answered = bool(groups) and any(m["role"] == "assistant" for m in groups[-1])
        if not groups or (message["role"] == "user" and answered):
            groups.append([message])
        else:
            groups[-1].append(message)
    return system, groups


def chat_windows(target: LoadedModel, messages: list[Message], max_length: int) -> list[list[int]]:
    """A chat longer than ``max_length`` as windows of whole exchanges (the module docstring)."""
    system, groups = exchanges(messages)
    windows: list[list[int]] = []
    start = 0
    while start < len(groups):
        end = start + 1
        ids = target.chat_ids(system + groups[start], generation_prompt=False)
        if len(ids) > max_length:
            shortened = _shortened(target.tokenizer, groups[start], max_length // 2)
            ids = target.chat_ids(system + shortened, generation_prompt=False)[:max_length]
        else:
            while end < len(groups):
                chat = system + [m for group in groups[start : end + 1] for m in group]
                longer = target.chat_ids(chat, generation_prompt=False)
                if len(longer) > max_length:
                    break
                ids, end = longer, end + 1
        windows.append(ids)
        start = end
    return windows


def _shortened(tokenizer: Any, group: list[Message], keep: int) -> list[Message]:
    """An exchange with its question (the user turns before the first answer, joined) cut to its last ``keep``
    tokens; the answers as they are."""
    first_answer = next((i for i, m in enumerate(group) if m["role"] != "user"), len(group))
    question = "\n".join(m["content"] for m in group[:first_answer])
    ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    if len(ids) > keep:
        question = tokenizer.decode(ids[len(ids) - keep :] if keep else [], skip_special_tokens=False)
    return [{"role": "user", "content": question}, *group[first_answer:]]
