"""A tiny model's JSON vocabulary (``PIECES``: each id a piece of JSON) and its tokenizer, and the schemas the
structured-output tests constrain it with."""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import specdecode.engine.request
from specdecode.structured import Constraint

# No whitespace pieces: the output is compact JSON, so a random model cannot spend its budget on blanks. Every letter
# of the literals and keys is a piece too: llguidance masks bytes, and a piece that starts a word no pieces can finish
# ("n" of "null" without "u" and "l") would be allowed and lead to a dead end.
PIECES = ["<eos>", "{", "}", "[", "]", '"', ":", ",", "a", "b", "c", "n", "e", "m", "g", "s", "t", "0", "1", "2"]


def closed(properties: dict, required: tuple[str, ...] = ()) -> dict:
    """An object schema with exactly these ``properties`` (no others), ``required`` among them."""
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


# Ten schemas whose every valid output is short: objects, arrays, enums, nesting, numbers, string patterns and lengths.
SCHEMAS = [
    closed({"ok": {"type": "boolean"}}, ("ok",)),
    closed({"name": {"type": "string", "maxLength": 5}}, ("name",)),
    closed({"age": {"type": "integer", "minimum": 0, "maximum": 99}}, ("age",)),
    closed({"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}),
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 1, "maxItems": 4},
    closed({"name": {"enum": ["ab", "ba", "cab"]}, "age": {"enum": [1, 2, None]}}, ("name", "age")),
    closed(
        {
            "name": closed(
                {"tags": {"type": "array", "items": closed({"ok": {"type": "boolean"}}, ("ok",)), "maxItems": 2}}
            )
        },
        ("name",),
    ),
    closed({"age": {"type": "number", "minimum": -1, "maximum": 2, "multipleOf": 0.5}}, ("age",)),
    closed({"name": {"type": "string", "pattern": "^[a-c]{2,4}$"}, "ok": {"const": True}}, ("name", "ok")),
    {
        "type": "array",
        "items": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "null"}]},
        "maxItems": 3,
    },
]


def json_tokenizer() -> PreTrainedTokenizerFast:
    return piece_tokenizer(PIECES)


def piece_tokenizer(pieces: list[str]) -> PreTrainedTokenizerFast:
    """Id i is ``pieces[i]`` (``pieces[0]`` the EOS); text is the pieces joined (encode splits at whitespace)."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(pieces)}, unk_token=pieces[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()  # text = the pieces joined
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=pieces[0], eos_token=pieces[0])


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character and newline (id 0 the EOS): any such text, one character a token."""
    chars = ["<eos>", "\n", *map(chr, range(32, 127))]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<eos>", eos_token="<eos>")


def mask_one_row_late(monkeypatch) -> None:
    """The grammar controls' fault: row i of a verify pass masked with row i−1's grammar state (row 0 keeps its
    own), and the constraint's bookkeeping made lenient, since the control's tokens break the grammar."""
    correct = specdecode.engine.request.mask_logits

    def late(logits, allowed):
        return correct(logits, None if allowed is None else torch.cat([allowed[:1], allowed[:-1]]))

    def lenient(self, tokens):
        for token in tokens:
            self.consume(token)  # a refused token leaves the matcher where it was
        return len(tokens)

    monkeypatch.setattr(specdecode.engine.request, "mask_logits", late)
    monkeypatch.setattr(Constraint, "advance", lenient)
