"""Write a repetitive bench workload (FastChat JSONL) from the Python standard library, for suffix decoding.

Two kinds of traffic, answered one after another in one process (``specdecode bench --prompts FILE``):
- ``records-*``: one instruction applied to many different records, here the source of pure-Python stdlib
  functions (JSON description, a fixed-format review): what repeats across answers is the shape, not the text.
- ``faq``: the same questions about stdlib modules asked again by other users (the same words, and the same
  words after a greeting), as support bots, retries and agent loops send them.

    python recipes/make_repetitive_workload.py docs/bench/suffix_decoding/repetitive.jsonl
"""

from __future__ import annotations

import calendar
import difflib
import fnmatch
import glob
import heapq
import inspect
import json
import shlex
import statistics
import string
import sys
import textwrap

FUNCTIONS = [
    textwrap.dedent,
    textwrap.indent,
    statistics.mean,
    string.capwords,
    shlex.quote,
    fnmatch.translate,
    glob.escape,
    heapq.nlargest,
    calendar.isleap,
    difflib.get_close_matches,
]
RECORD_TASKS = {
    "records-json": 'Describe this Python function as JSON with the keys "name", "arguments" and "summary". '
    "Reply with the JSON only.\n\n{source}",
    "records-review": "Review this function. Answer in exactly this format:\nName: <function name>\n"
    "Purpose: <one sentence>\nInputs: <list>\nOutput: <one sentence>\nRisks: <one sentence>\n\n{source}",
}
MODULES = ["json", "csv", "pathlib", "itertools", "functools", "collections", "re", "datetime"]
FAQ = "What does the Python module `{module}` do? Give a short example."
GREETINGS = ["", "", "Hi! "]  # the first asking, the same words again, the same words after a greeting
SOURCE_CHARS = 1500


def items() -> list[dict]:
    """The workload's questions in the order they are sent."""
    out = []
    for category, task in RECORD_TASKS.items():
        for function in FUNCTIONS:
            source = inspect.getsource(function)[:SOURCE_CHARS]
            out.append({"category": category, "turns": [task.format(source=source)]})
    for greeting in GREETINGS:
        for module in MODULES:
            out.append({"category": "faq", "turns": [greeting + FAQ.format(module=module)]})
    return [{"question_id": i + 1, **item} for i, item in enumerate(out)]


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python recipes/make_repetitive_workload.py OUT.jsonl")
    with open(sys.argv[1], "w", encoding="utf-8") as handle:
        for item in items():
            handle.write(json.dumps(item) + "\n")


if __name__ == "__main__":
    main()
