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

from .data import Message, Sample


def token_windows(tokenizer: Any, sample: Sample, max_length: int) -> list[list[int]]:
    """``sample``'s token ids in windows of at most ``max_length`` tokens (see the module docstring); a chat with
    no chat template is its turns' text joined by newlines, cut to ``max_length``."""
    if isinstance(sample, str):
        ids = [int(t) for t in tokenizer(sample, add_special_tokens=True, verbose=False)["input_ids"]]
        return [ids[start : start + max_length] for start in range(0, len(ids), max_length)] or [[]]
    if not getattr(tokenizer, "chat_template", None):
        ids = tokenizer("\n".join(m["content"] for m in sample), add_special_tokens=True)["input_ids"]
        return [[int(t) for t in ids[:max_length]]]
    ids = chat_ids(tokenizer, sample)
    if len(ids) <= max_length:
        return [ids]
    return chat_windows(tokenizer, sample, max_length)


def chat_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """The chat template's token ids for ``messages``."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    return [int(t) for t in (ids if isinstance(ids, list) else ids["input_ids"])]


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


def chat_windows(tokenizer: Any, messages: list[Message], max_length: int) -> list[list[int]]:
    """A chat longer than ``max_length`` as windows of whole exchanges (the module docstring)."""
    system, groups = exchanges(messages)
    windows: list[list[int]] = []
    start = 0
    while start < len(groups):
        end = start + 1
        ids = chat_ids(tokenizer, system + groups[start])
        if len(ids) > max_length:
            ids = chat_ids(tokenizer, system + _shortened(tokenizer, groups[start], max_length // 2))[:max_length]
        else:
            while end < len(groups):
                longer = chat_ids(tokenizer, system + [m for group in groups[start : end + 1] for m in group])
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
