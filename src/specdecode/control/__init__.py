"""Online control of speculation: ONE acceptance estimator (``acceptance``) and ONE pass-cost model (``costs``),
and the decisions over them: ``gamma="auto"`` per request (``gamma``) and, in ``serving.batching.policy``, the server's
per-step plan. Pure Python, no torch: they learn from the counts and times the engine and the scheduler report."""

from .acceptance import (
    MEMORY_FORGETTING,
    PRIOR_WEIGHT,
    REQUEST_FORGETTING,
    AcceptanceHistory,
    RequestAcceptance,
    posterior_means,
)
from .costs import PassCosts
from .gamma import AdaptiveGamma, HybridGamma, best_length
from .probing import ProbeSchedule

__all__ = [
    "MEMORY_FORGETTING",
    "PRIOR_WEIGHT",
    "REQUEST_FORGETTING",
    "AcceptanceHistory",
    "AdaptiveGamma",
    "HybridGamma",
    "PassCosts",
    "ProbeSchedule",
    "RequestAcceptance",
    "best_length",
    "posterior_means",
]
