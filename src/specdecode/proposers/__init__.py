"""Proposers: where draft tokens come from."""

from ..sampling.draft import Draft
from .base import Proposer
from .draft_model import DraftModelProposer
from .eagle import EagleProposer, EagleSettings
from .hybrid import HybridProposer
from .layer_skip import LayerSkipProposer
from .medusa import MedusaProposer
from .prompt_lookup import PromptLookupProposer
from .suffix import SuffixHistory, SuffixProposer

__all__ = [
    "Draft",
    "DraftModelProposer",
    "EagleProposer",
    "EagleSettings",
    "HybridProposer",
    "LayerSkipProposer",
    "MedusaProposer",
    "PromptLookupProposer",
    "Proposer",
    "SuffixHistory",
    "SuffixProposer",
]
