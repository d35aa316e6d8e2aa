"""Models and proposers from their names: the words the CLI's options and the server's config share.

Messages name the CLI's flags (``--tree-width``): the CLI is where those words are typed; the server passes its
config's fields through unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .models.loaded import LoadedModel
    from .proposers import Proposer, SuffixProposer
    from .proposers.hybrid import HybridProposer


HYBRID_MODELS = ("eagle", "medusa", "draft")  # what drafts a hybrid's rounds where nothing is copied
HYBRID_COPIERS = ("suffix", "lookup")  # what copies in a hybrid's rounds: suffix decoding or prompt lookup
LOOKUP_MIN_ORDER = 2  # a hybrid copies after prompt lookup's 2- and 3-gram matches (1 to 3 measured: BENCHMARKS.md)


def parse_quantization(text: str) -> str | None:
    """``--quantization`` words: ``none`` = dense, else auto / gguf / int8 / int4."""
    from .models.loading.quantize import QUANTIZATIONS

    if text == "none":
        return None
    if text not in ("auto", *QUANTIZATIONS):
        raise ValueError(f"--quantization must be auto, {', '.join(QUANTIZATIONS)} or none, got {text!r}")
    return text


def load(
    name: str, dtype: str, quantization: str = "auto", group_size: int = 32, max_context: int | None = None
) -> LoadedModel:
    """A model from CLI words (``--quantization`` as the CLI spells it; ``--max-context``)."""
    from .models.loading.loader import load_model

    return load_model(
        name, dtype=dtype, quantization=parse_quantization(quantization), group_size=group_size, max_context=max_context
    )


def build_proposer(
    kind: str,
    target: LoadedModel,
    draft: str | None,
    dtype: str = "auto",
    quantization: str = "auto",
    group_size: int = 32,
    head: str | None = None,
    tree_nodes: int | None = None,
    heads: str | None = None,
    tree_width: int = 1,
    suffix_cache: str | None = None,
    suffix_remember: bool = True,
) -> Proposer:
    """A proposer from CLI words: ``lookup``, ``eagle`` (with a head folder or the shipped head; ``tree_nodes``
    0 = a chain), ``medusa`` (with a ``heads`` folder or the shipped heads; ``tree_nodes`` as for eagle),
    ``suffix`` (over the history in ``suffix_cache`` if that file exists), or ``draft`` with a path, ``self:N``
    or ``skip:SKIP.json`` / ``skip:LIST`` (the target without those layers); ``tree_width`` > 1: lookup offers
    that many distinct matches as a token tree; ``MODEL+suffix`` / ``MODEL+lookup`` (``eagle+lookup``): a
    ``HybridProposer`` copying where the text repeats (suffix decoding; prompt lookup's 2- and 3-gram matches),
    else drafting with MODEL. A draft model loads with ``load``; ``suffix_remember`` False: a hybrid's copier
    keeps no request's text once it ends (the server's request scope)."""
    from .proposers import DraftModelProposer, EagleProposer, MedusaProposer, PromptLookupProposer
    from .proposers.hybrid import HybridProposer
    from .proposers.layer_skip import self_draft_model

    if tree_width < 1:
        raise ValueError(f"--tree-width must be >= 1, got {tree_width}")
    if suffix_cache is not None and kind != "suffix" and not kind.endswith("+suffix"):
        raise ValueError(f"--suffix-cache applies to the suffix proposer, not {kind}")
    if tree_width > 1 and kind != "lookup":
        raise ValueError(f"--tree-width applies to the lookup proposer, not {kind}")
    if heads is not None and kind.partition("+")[0] != "medusa":
        raise ValueError(f"--heads applies to the medusa proposer, not {kind}")
    if "+" in kind:  # a model + a copier: HybridProposer
        model_kind, _, copier = kind.partition("+")
        if copier not in HYBRID_COPIERS or model_kind not in HYBRID_MODELS:
            raise ValueError(
                f"unknown proposer {kind!r}: a hybrid is MODEL+suffix or MODEL+lookup, MODEL one of "
                f"{', '.join(HYBRID_MODELS)}"
            )
        model = build_proposer(model_kind, target, draft, dtype, quantization, group_size, head, tree_nodes, heads)
        if copier == "lookup":
            return lookup_hybrid(model)
        return HybridProposer(model, suffix_proposer(suffix_cache, remember=suffix_remember))
    if kind == "lookup":
        return PromptLookupProposer(branches=tree_width)
    if kind in ("eagle", "medusa"):
        if tree_nodes is not None and tree_nodes < 0:
            raise ValueError(f"--tree-nodes must be >= 0 (0 = a chain), got {tree_nodes}")
        shape = {} if tree_nodes is None else {"tree_nodes": tree_nodes or None}
        if kind == "medusa":
            return MedusaProposer(target, heads=heads, **shape)
        return EagleProposer(target, head=head, **shape)
    if kind == "suffix":
        return suffix_proposer(suffix_cache, tree_nodes)
    if kind != "draft":
        raise ValueError(
            f"unknown proposer {kind!r}: use draft, lookup, eagle, medusa, suffix, eagle+suffix, eagle+lookup or none"
        )
    if draft is None:
        raise ValueError("the draft proposer needs --draft PATH or --draft self:N")
    own = self_draft_model(target, draft)
    return DraftModelProposer(own if own is not None else load(draft, dtype, quantization, group_size))


def lookup_hybrid(model: Proposer) -> HybridProposer:
    """``MODEL+lookup``: prompt lookup's draft after a 2- or 3-gram match (a 1-token copy counts), else ``model``'s."""
    from .proposers import PromptLookupProposer
    from .proposers.hybrid import HybridProposer

    return HybridProposer(model, PromptLookupProposer(), min_order=LOOKUP_MIN_ORDER, min_copied=1)


def suffix_proposer(cache: str | None, tree_nodes: int | None = None, remember: bool = True) -> SuffixProposer:
    """A SuffixProposer over the history file ``cache`` (loaded if it exists; a new history otherwise)."""
    from .proposers import SuffixProposer

    if tree_nodes is not None and tree_nodes < 0:
        raise ValueError(f"--tree-nodes must be >= 0 (0 = a chain), got {tree_nodes}")
    shape = {} if tree_nodes is None else {"tree_nodes": tree_nodes}
    if cache is not None and Path(cache).expanduser().is_dir():
        raise IsADirectoryError(f"--suffix-cache must be a file, got the folder {cache}")
    if cache is not None and Path(cache).expanduser().exists():
        return SuffixProposer.load(Path(cache).expanduser(), remember=remember, **shape)
    return SuffixProposer(remember=remember, **shape)
