"""specdecode: speculative decoding that makes generation faster without changing its output."""

from . import sampling
from .engine import GenerationOutput, SpeculativeDecoder, autoregressive_generate
from .engine.stats import DecodeStats
from .errors import ModelNotAvailable, SpecDecodeError, VocabularyMismatch
from .models import LoadedModel, load_model
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
from .sampling import verify
from .sampling.params import SamplingParams
from .structured import Grammar
from .version import __version__

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
    "__version__",
    "autoregressive_generate",
    "load_model",
    "sampling",
    "verify",
]
