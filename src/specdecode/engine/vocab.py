"""Target and draft must share one vocabulary, token for token."""

from __future__ import annotations

from ..errors import VocabularyMismatch
from ..models.loaded import LoadedModel


def check_vocabularies(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise VocabularyMismatch naming the first token id whose text differs (padding rows are ignored)."""
    if target.tokenizer is None or draft.tokenizer is None:
        if target.vocab_size != draft.vocab_size:
            raise VocabularyMismatch(
                f"target has {target.vocab_size} tokens, draft has {draft.vocab_size}: they cannot be paired"
            )
        return
    if target.tokenizer is draft.tokenizer:
        return
    target_tokens = target.tokenizer.convert_ids_to_tokens(list(range(target.vocab_size)))
    draft_tokens = draft.tokenizer.convert_ids_to_tokens(list(range(draft.vocab_size)))
    for token_id in range(max(len(target_tokens), len(draft_tokens))):
        mine = target_tokens[token_id] if token_id < len(target_tokens) else None
        theirs = draft_tokens[token_id] if token_id < len(draft_tokens) else None
        if mine != theirs:
            raise VocabularyMismatch(
                f"vocabularies differ at token id {token_id}: target has {mine!r}, draft has {theirs!r} "
                f"(target {target.vocab_size} tokens, draft {draft.vocab_size}); pair models that share a tokenizer"
            )
