"""specdecode: speculative decoding that makes generation faster without changing its output."""

from . import sampling, verify
from .engine import GenerationOutput, SpeculativeDecoder, autoregressive_generate
from .errors import ModelNotAvailable, SpecDecodeError, VocabularyMismatch
from .models import LoadedModel, load_model
from .params import SamplingParams
from .proposers import (
    Draft,
    DraftModelProposer,
    EagleProposer,
    HybridProposer,
    LayerSkipProposer,
    MedusaProposer,
    PromptLookupProposer,
    Proposer,
    SuffixHistory,
    SuffixProposer,
)
from .stats import DecodeStats
from .structured import Grammar

__all__ = [
    "DecodeStats",
    "Draft",
    "DraftModelProposer",
    "EagleProposer",
    "HybridProposer",
    "GenerationOutput",
    "LayerSkipProposer",
    "LoadedModel",
    "MedusaProposer",
    "ModelNotAvailable",
    "PromptLookupProposer",
    "Proposer",
    "Grammar",
    "SamplingParams",
    "SpecDecodeError",
    "SpeculativeDecoder",
    "SuffixHistory",
    "SuffixProposer",
    "VocabularyMismatch",
    "autoregressive_generate",
    "load_model",
    "sampling",
    "verify",
]
