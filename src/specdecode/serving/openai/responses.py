"""OpenAI's response shapes: whole bodies, stream chunks (one choice each), the usage, and each choice's seed."""

from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Any

from ...engine.request import GenerationOutput
from ...engine.stats import DecodeStats
from .protocol import MAX_SEED
from .tokens import TokenRecord, chat_logprobs_json, completion_logprobs_json, sources_json
from .tool_calls import CallParser, CallStream


def finish_reason(output: GenerationOutput) -> str:
    """OpenAI's words: ``stop`` (EOS or a stop string) or ``length`` (max_tokens)."""
    return "length" if output.finish_reason == "length" else "stop"


def usage(
    prompt_tokens: int, completion_tokens: int, stats: DecodeStats | None = None, cached_tokens: int | None = None
) -> dict[str, Any]:
    """Token counts (the prompt once, every choice's completion); with the final ``stats`` (every choice's, summed)
    also drafted/accepted (and OpenAI's predicted-output details); ``cached_tokens``: the prompt's tokens the prefix
    cache supplied (OpenAI's ``prompt_tokens_details``)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if stats is not None:
        out["drafted_tokens"] = stats.drafted
        out["accepted_tokens"] = stats.accepted
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": stats.accepted,
            "rejected_prediction_tokens": stats.drafted - stats.accepted,
        }
        out["speculation"] = {
            "rounds": stats.rounds,
            "tokens_per_round": stats.tokens_per_round,
            "acceptance_by_depth": stats.per_position_rate,
            "draft_seconds": stats.draft_seconds,
            "verify_seconds": stats.verify_seconds,
            "total_seconds": stats.total_seconds,
        }
    return out


def final_usage(prompt_tokens: int, outputs: list[GenerationOutput]) -> dict[str, Any]:
    """The usage of a finished request: every choice's tokens and speculation counters, summed."""
    stats = functools.reduce(DecodeStats.merge, (o.stats for o in outputs))
    return usage(prompt_tokens, sum(len(o.token_ids) for o in outputs), stats, outputs[0].cached_tokens)


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: ``seed`` itself for choice 0 (n = 1 answers as before), a distinct odd-multiple
    offset (mod 2**63) for the others — a function of (seed, index) only, so the request's seed replays every choice."""
    return (seed + index * 0x9E3779B97F4A7C15) % MAX_SEED


class Shape:
    """Responses and stream chunks of one request, in the shape of its route; with ``sources`` or
    ``logprobs`` (not None), each choice also carries its tokens' records (``tokens``); with ``calls`` (the parser of
    the model's tool-call convention), the calls of an answer are OpenAI ``tool_calls`` with ``finish_reason``
    ``tool_calls`` (streamed as OpenAI streams them: ``CallStream``), and an answer cut (max_tokens) inside a call is
    its text; ``forced``: the answer is calls only (its first chunk says ``content: null``)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        prompt_tokens: int,
        sources: bool = False,
        logprobs: int | None = None,
        seed: int | None = None,
        choices: int = 1,
        calls: CallParser | None = None,
        forced: bool = False,
    ) -> None:
        self.chat = chat
        self.calls = calls if chat else None
        self.forced = forced
        self._streams = [CallStream(calls) for _ in range(choices)] if self.calls is not None else []
        self.seed = seed  # the request's seed, in every body and chunk (a run can be replayed)
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.sources = sources
        self.logprobs = logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._text_offset = [0] * choices  # completions' logprobs: where a choice's next tokens start in its answer

    @property
    def wants_tokens(self) -> bool:
        return self.sources or self.logprobs is not None

    def _extras(self, choice: dict[str, Any], records: list[TokenRecord] | None) -> dict[str, Any]:
        """Put the records' logprobs (in the route's shape) and sources into ``choice``."""
        if records is None:
            return choice
        if self.logprobs is not None:
            if self.chat:
                choice["logprobs"] = chat_logprobs_json(records)
            else:
                index = choice["index"]
                choice["logprobs"] = completion_logprobs_json(records, self._text_offset[index])
                self._text_offset[index] += sum(len(r.text) for r in records)
        if self.sources:
            choice["sources"] = sources_json(records)
        return choice

    def _envelope(self, kind: str, choices: list[dict[str, Any]], usage_: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage_ is not None:
            body["usage"] = usage_
        if self.seed is not None:
            body["seed"] = self.seed
        return body

    def response(
        self, outputs: list[GenerationOutput], records: list[list[TokenRecord] | None] | None = None
    ) -> dict[str, Any]:
        """The non-streaming body, one choice per output (``records``: each choice's tokens, when asked for)."""
        choices = []
        for index, output in enumerate(outputs):
            if self.chat:
                message, reason = self._message(output)
                choice = {"index": index, "message": message, "logprobs": None, "finish_reason": reason}
            else:
                reason = finish_reason(output)
                choice = {"index": index, "text": output.text, "logprobs": None, "finish_reason": reason}
            choices.append(self._extras(choice, None if records is None else records[index]))
        kind = "chat.completion" if self.chat else "text_completion"
        return self._envelope(kind, choices, final_usage(self.prompt_tokens, outputs))

    def _message(self, output: GenerationOutput) -> tuple[dict[str, Any], str]:
        """A chat choice's message and finish reason: its calls as ``tool_calls``, else the text."""
        if self.calls is not None:
            message, called = self.calls.message(output.text, cut=output.finish_reason == "length")
            return message, "tool_calls" if called else finish_reason(output)
        return {"role": "assistant", "content": output.text}, finish_reason(output)

    def pieces(
        self,
        text: str,
        usage_: dict[str, Any] | None = None,
        records: list[TokenRecord] | None = None,
        index: int = 0,
    ) -> list[str]:
        """The events of choice ``index``'s next ``text`` (none if it settles nothing and has no records); with
        ``calls``, one event per content or tool-call delta (``CallStream``), the records on the last."""
        if self.calls is None:
            return [self.chunk(text, usage_=usage_, records=records, index=index)] if text or records else []
        deltas = self._streams[index].feed(text)
        if not deltas and records:
            deltas = [{}]
        last = len(deltas) - 1
        return [
            self._delta(delta, None, usage_ if i == last else None, records if i == last else None, index)
            for i, delta in enumerate(deltas)
        ]

    def _delta(
        self,
        delta: dict[str, Any],
        reason: str | None,
        usage_: dict[str, Any] | None,
        records: list[TokenRecord] | None,
        index: int,
    ) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        return sse(self._envelope("chat.completion.chunk", [self._extras(choice, records)], usage_))

    def finish(
        self,
        output: GenerationOutput,
        usage_: dict[str, Any] | None = None,
        records: list[TokenRecord] | None = None,
        index: int = 0,
    ) -> list[str]:
        """A choice's last events: with ``calls``, the deltas the whole answer settles (held-back text, the end of
        a call); then the finish reason."""
        if self.calls is None:
            return [self.chunk("", finish_reason(output), usage_, records=records, index=index)]
        events = [self._delta(delta, None, None, None, index) for delta in self._streams[index].feed("", final=True)]
        _, reason = self._message(output)
        return [*events, self._delta({}, reason, usage_, records, index)]

    def chunk(
        self,
        text: str,
        reason: str | None = None,
        usage_: dict[str, Any] | None = None,
        role: bool = False,
        records: list[TokenRecord] | None = None,
        index: int = 0,
    ) -> str:
        """One server-sent event for choice ``index``: a text delta (chat: the first carries the role; an answer of
        calls only says ``content: null``) with its tokens' ``records``, or the finish reason."""
        if self.chat:
            if role:
                delta: dict[str, Any] = {"role": "assistant", "content": None if self.forced else text}
            else:
                delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        choice = self._extras(choice, records)
        return sse(self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], usage_))

    def usage_chunk(self, outputs: list[GenerationOutput]) -> str:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage of every choice."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._envelope(kind, [], final_usage(self.prompt_tokens, outputs)))


def sse(body: dict[str, Any] | str) -> str:
    """``data: <json>`` and a blank line (``[DONE]`` as is)."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")
