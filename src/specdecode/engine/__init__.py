"""The decoding loop: ``SpeculativeDecoder`` (draft, verify, emit, round after round) and the plain baseline
``autoregressive_generate``, over a request's state (``request``), its output and stop handling (``output``), each
token's source and logprobs (``provenance``), its counters (``stats``), KV reuse across requests (``prefix_reuse``)
and the target/draft vocabulary check (``vocab``)."""

from .decoder import SpeculativeDecoder, autoregressive_generate
from .request import GenerationOutput

__all__ = ["GenerationOutput", "SpeculativeDecoder", "autoregressive_generate"]
