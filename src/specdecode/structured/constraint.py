"""A request's grammar state over its accepted output, and the masks of a round's verified rows.

The grammar is part of the target's distribution: at every row the target scores, the tokens the grammar forbids
after that row's context (the accepted output, then the drafted tokens before the row) get logit −∞
(``mask_logits``), in plain decoding and in every verification rule alike. A drafted token the grammar forbids then
has target probability 0 and is rejected by every rule; the rows past it are never reached.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .grammar import Grammar, llguidance_module

_BIT = torch.arange(32, dtype=torch.int32)
_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], tuple[object, object]] = {}  # id → (tokenizer, LLTokenizer)


class _TokenList:
    """What llguidance's ``TokenizerWrapper`` reads, for a tokenizer llguidance cannot parse (a word-level one):
    each token's bytes are its own decoded text; special tokens (EOS among them) are marked with a leading 0xFF
    byte, as llguidance expects, so that no text matches them."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]) -> None:
        special = set(eos)
        self.tokens = [self._bytes(tokenizer, i, special) for i in range(vocab_size)]
        self.special_token_ids = sorted(special)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        self._ids = {piece: i for i, piece in enumerate(self.tokens) if piece and i not in special}
        self._longest = max(map(len, self._ids), default=1)

    @staticmethod
    def _bytes(tokenizer, token: int, special: set[int]) -> bytes:
        if token >= len(tokenizer):
            return b""
        if token in special:
            return b"\xff" + str(tokenizer.convert_ids_to_tokens(token)).encode()
        return tokenizer.decode([token]).encode()

    def __call__(self, text: str | bytes) -> list[int]:
        """Greedy longest-match tokenization of ``text`` (llguidance tokenizes forced text with it)."""
        data, ids, start = text.encode() if isinstance(text, str) else text, [], 0
        while start < len(data):
            end = next(
                (e for e in range(min(len(data), start + self._longest), start, -1) if data[start:e] in self._ids), 0
            )
            if not end:  # no token spells what follows: the tokens of the part that is spelled
                break
            ids.append(self._ids[data[start:end]])
            start = end
        return ids


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids: Iterable[int]):
    """llguidance's tokenizer for ``tokenizer`` padded to ``vocab_size`` ids (~1 s to build at 262k tokens:
    cached per tokenizer object)."""
    eos = sorted(eos_ids)
    key = (id(tokenizer), vocab_size, tuple(eos))
    if key in _TOKENIZERS and _TOKENIZERS[key][0] is tokenizer:
        return _TOKENIZERS[key][1]
    ll = llguidance_module()
    import llguidance.hf

    size = max(vocab_size, len(tokenizer))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:  # a byte-level or SentencePiece tokenizer: llguidance reads its pieces itself
        if backend is None or backend.decoder is None:
            raise ValueError("no decoder")
        built = llguidance.hf.from_tokenizer(tokenizer, n_vocab=size, eos_token=eos or None)
    except ValueError:  # one llguidance cannot parse (word-level, no decoder): each token's decoded text
        built = ll.LLTokenizer(
            ll.TokenizerWrapper(_TokenList(tokenizer, size, eos)), n_vocab=size, eos_token=eos or None
        )
    if len(_TOKENIZERS) >= 8:
        _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
    _TOKENIZERS[key] = (tokenizer, built)
    return built


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with −∞ where ``allowed`` [rows, V] is False (None: unchanged). Applied after the logit
    transforms that change values (penalties, logit_bias), before temperature, top-k and top-p."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed, float("-inf"))


class Constraint:
    """``grammar``'s matcher, advanced over a request's emitted tokens (the prompt is not matched: the grammar
    constrains the output). ``chain_masks`` and ``tree_masks`` give the rows of a round, each under the grammar
    state after the drafted tokens before it, and leave the matcher where it was (llguidance's rollback)."""

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int, eos_ids: Iterable[int]) -> None:
        if tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model was loaded without one")
        ll = llguidance_module()
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_ids)
        self.can_end = bool(self.eos)
        self._recorded: list[int] = []  # per token consumed: the entries llguidance recorded for it (1, or 0)
        words = ll_tokenizer(tokenizer, vocab_size, eos_ids)
        self.matcher = ll.LLMatcher(words, grammar.compiled(), log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the {grammar.kind.replace('_', ' ')} does not compile: {self.matcher.get_error()}")
        self._bits = torch.zeros((words.vocab_size + 31) // 32, dtype=torch.int32)

    def mask(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next in the matcher's current state; every token once the
        grammar has ended (past its end or an end-of-sequence token: a row no output reaches)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        allowed = ((self._bits.unsqueeze(-1) >> _BIT) & 1).bool().flatten()[: self.vocab_size]
        if bool(allowed.any()):
            return allowed
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar's matcher failed: {self.matcher.get_error().splitlines()[0]}")
        if self.matcher.is_stopped():
            return torch.ones_like(allowed)
        raise ValueError("the grammar reached a state that no token of this vocabulary continues")

    def chain_masks(self, draft: list[int]) -> tuple[torch.Tensor, int]:
        """(allowed [n + 1, V], n): row j is the mask after ``draft[:j]``; n counts the leading drafted tokens the
        grammar allows (draft[n], if any, is forbidden: its row and those past it are not needed)."""
        rows, n = [self.mask()], 0
        while n < len(draft) and bool(rows[-1][draft[n]]) and self.consume(draft[n]):
            n += 1
            rows.append(self.mask())
        self.rollback(n)
        return torch.stack(rows), n

    def tree_masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """[len(tokens) + 1, V]: row 0 under the accepted output, row i + 1 after node i's root path (parents[i] <
        i, −1 the root). A node below a forbidden one is never reached: its row allows every token."""
        rows = [self.mask()]
        for node in range(len(tokens)):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            consumed = self.matcher.try_consume_tokens([tokens[i] for i in reversed(path)])
            rows.append(self.mask() if consumed == len(path) else torch.ones(self.vocab_size, dtype=torch.bool))
            self.matcher.rollback(consumed)
        return torch.stack(rows)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (each the only token its mask allows), in order; none past
        the output's end (a forced end-of-sequence token is the target's own next token, masked to it)."""
        tokens: list[int] = []
        while len(tokens) < limit:
            allowed = self.mask()
            if int(allowed.sum()) != 1:
                break
            token = int(allowed.nonzero()[0])
            if token in self.eos or not self.consume(token):
                break
            tokens.append(token)
        self.rollback(len(tokens))
        return tokens

    def advance(self, tokens: list[int]) -> int:
        """Move the matcher past the verified ``tokens`` (each drawn under its mask, so allowed) and return how many
        the output keeps: all, or (``ended``) up to the one that completed a grammar the model cannot end with an
        end-of-sequence token."""
        for n, token in enumerate(tokens):
            if self.ended:
                return n
            if not self.consume(token):
                raise RuntimeError(f"the grammar refused a verified token {token}")
        return len(tokens)

    def consume(self, token: int) -> bool:
        """Move the matcher past ``token``; False (the matcher unchanged) if the grammar forbids it. An
        end-of-sequence token after the grammar's end is allowed and changes nothing: llguidance records no entry
        for it, so each token's entries are kept for ``rollback``."""
        if self.matcher.is_stopped():
            if token not in self.eos:
                return False
            self._recorded.append(0)
            return True
        if self.matcher.try_consume_tokens([token]) != 1:
            return False
        self._recorded.append(1)
        return True

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` tokens consumed (the output did not keep them: a stop string, the token budget,
        a look ahead)."""
        if count:
            entries = sum(self._recorded[-count:])
            del self._recorded[-count:]
            if entries:
                self.matcher.rollback(entries)

    @property
    def ended(self) -> bool:
        """The output is complete: the grammar allows nothing more and the model has no end-of-sequence token
        (with one, the grammar's mask allows only it, and the model's EOS ends the output)."""
        return not self.can_end and self.matcher.is_stopped()
