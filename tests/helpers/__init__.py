"""Shared test helpers, imported (never copied): ``models`` (tiny random models, the word-tokenizer target),
``tokenizers`` (word-level tokenizers, chat files), ``laws`` (law checks and wrong verifiers), ``trees`` (random
token trees), ``reference`` (transformers' own no-cache forward), ``bench`` (the check both head proposers share)."""
