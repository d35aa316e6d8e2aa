"""Word-level text: a tokenizer whose id i is a given word, and chat files of such words."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(64)]  # id i is "wi": the words of the LARGE_VOCAB models
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # each message's words, no markers


def fixed_width_words(n: int) -> list[str]:
    """``n`` words "w00", "w01", ...: none is a prefix of another (so a stop string matches one word only)."""
    return [f"w{i:02d}" for i in range(n)]


def word_tokenizer(words: list[str], eos: str | None = None) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer whose id i is ``words[i]`` (decode joins tokens with spaces)."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0], eos_token=eos)


def write_chats(path, questions: list[str]):
    """A JSONL file of one-turn chats (each question with a placeholder answer, "w1"), as make-data reads them."""
    lines = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "w1"}]} for q in questions]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
