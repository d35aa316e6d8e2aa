"""What ``specdecode serve`` serves (``ServerConfig``) and the checks made before a model loads: the context each
request may hold, and whether ``max_batch`` such requests fit the memory available."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..models.loaded import LoadedModel
from ..proposers import DraftModelProposer, HybridProposer, PromptLookupProposer, Proposer, SuffixProposer
from .batching.policy import POLICIES

SUFFIX_SCOPES = ("global", "request")
RESERVE_FIX = "lower --max-batch or --max-context"
SERVER_CONTEXT = 4096  # tokens per request by default (less where the model's window is shorter), as llama-server


@dataclass(frozen=True)
class ServerConfig:
    """What ``specdecode serve`` serves and how (picklable when ``target`` is a name: Ray ships it to replicas).

    ``proposer``: the default proposer (``lookup``, ``draft`` with ``draft`` = a model path, ``self:N`` or
    ``skip:SKIP.json``, ``eagle``, ``medusa``, ``suffix``, a hybrid ``MODEL+suffix`` / ``MODEL+lookup`` such as
    ``eagle+lookup``, or ``none``); requests may pick ``none``, ``lookup``, this one, or a name in
    ``proposers`` (extra factories).
    ``gamma``: the most tokens a round drafts (an integer or ``auto`` = up to ``max_gamma``); ``policy``:
    ``auto`` (speculate when the measured costs say it pays), ``always`` or ``never``; ``mode``: the verification
    rule, ``reproducible`` (default: a seed gives the same text whatever the batch or the policy does) or
    ``exact``. ``suffix_scope``: with the suffix proposer or a hybrid, ``global`` (one history of every request's prompt
    and answer, updated as requests end) or ``request`` (each request drafts from its own tokens and the
    ``suffix_cache`` corpus only); ``suffix_cache``: a history file loaded at start (global scope: saved back at
    shutdown).
    """

    target: str | LoadedModel = "smollm2"
    proposer: str = "lookup"
    draft: str | None = None
    gamma: int | str = "auto"
    max_gamma: int = 8
    policy: str = "auto"
    mode: str = "reproducible"
    max_batch: int = 16
    api_key: str | None = None
    max_body_bytes: int = 1_000_000
    served_model_name: str | None = None
    dtype: str = "auto"  # load_model's default: an HF folder's own dtype, float32 for a GGUF's dense path
    quantization: str = "auto"
    group_size: int = 32
    threads: int | None = None
    proposers: Mapping[str, Callable[[], Proposer]] = field(default_factory=dict)
    suffix_cache: str | None = None
    suffix_scope: str = "global"
    heads: str | None = None  # proposer medusa: a folder of trained heads (default: the shipped ones)
    max_context: int | None = None  # tokens per request, prompt and output (default: SERVER_CONTEXT or the window)
    prefix_cache_gb: float | None = None  # KV of earlier requests' prefixes (None: prefix_cache's default; 0: off)
    host: str = "127.0.0.1"  # the address served: with allowed_hosts, the Host names answered (hosts.py)
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context must be >= 1 token, got {self.max_context}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.prefix_cache_gb is not None and self.prefix_cache_gb < 0:
            raise ValueError(f"prefix_cache_gb must be >= 0 (0 turns the cache off), got {self.prefix_cache_gb}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.mode not in ("reproducible", "exact"):
            raise ValueError(f"mode must be reproducible or exact, got {self.mode!r}")
        if self.gamma != "auto" and (isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1):
            raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {self.gamma!r}")
        if self.proposer == "draft" and not self.draft:
            raise ValueError("the draft proposer needs a draft model: a path, self:N or skip:SKIP.json")
        if self.suffix_scope not in SUFFIX_SCOPES:
            raise ValueError(f"suffix_scope must be one of {', '.join(SUFFIX_SCOPES)}, got {self.suffix_scope!r}")
        if self.suffix_cache is not None and not self.copies:
            raise ValueError("--suffix-cache applies to --proposer suffix or a hybrid (eagle+suffix)")
        if self.heads is not None and self.proposer.partition("+")[0] != "medusa":
            raise ValueError("--heads applies to --proposer medusa (or medusa+suffix)")

    @property
    def copies(self) -> bool:
        """Whether the proposer drafts from a suffix history (``suffix``, ``MODEL+suffix``)."""
        return self.proposer == "suffix" or self.proposer.endswith("+suffix")


def server_context(config: ServerConfig, window: int | None) -> int:
    """Tokens per request: ``max_context`` if set, else ``SERVER_CONTEXT`` or the model's window if shorter."""
    if config.max_context is not None:
        return config.max_context
    return SERVER_CONTEXT if window is None else min(window, SERVER_CONTEXT)


def reserve_memory(config: ServerConfig) -> int | None:
    """Refuse (one line) a config whose ``max_batch`` requests of its context do not fit the memory available: the
    target's weights (and a draft model's), each request's KV cache and the largest pass's scratch, from the GGUF
    files' metadata before any weight is read. Return the context (None: not a GGUF file, the model's window)."""
    from ..factory import parse_quantization
    from ..models.loading.plan import planned_footprint
    from ..models.memory import check_fits

    quantization = parse_quantization(config.quantization)
    plan = planned_footprint(config.target, config.dtype, quantization, config.group_size)
    if plan is None:  # not a GGUF file: nothing to read the sizes from before loading
        return config.max_context
    found, window = plan
    context = server_context(config, window)
    drafted = config.draft if config.proposer.partition("+")[0] == "draft" else None
    draft = None if drafted is None or drafted.startswith(("self:", "skip:")) else planned_footprint(drafted)
    name = str(config.target) if draft is None else f"{config.target} with draft {drafted}"
    check_fits(name, found if draft is None else found + draft[0], context, config.max_batch, fix=RESERVE_FIX)
    return context


def capped_to_context(config: ServerConfig, loaded: LoadedModel) -> LoadedModel:
    """``loaded`` capped to the config's context (a copy: the caller's model keeps its own cap), after refusing (one
    line) a config whose ``max_batch`` requests' KV caches and scratch do not fit (its weights are in memory)."""
    from ..models.memory import check_fits, loaded_footprint

    context = server_context(config, loaded.context_window)
    if loaded.backend == "native":
        found = dataclasses.replace(loaded_footprint(loaded), mapped=0, repacked=0)
        check_fits(loaded.name, found, context, config.max_batch, fix=RESERVE_FIX)
    return loaded if loaded.max_context == context else dataclasses.replace(loaded, max_context=context)


def replicate(proposer: Proposer) -> Callable[[], Proposer]:
    """A factory of proposers like ``proposer``, each with its own state (draft KV cache, n-gram index).

    An unknown kind is shared: proposers resync to the context they are given, so sharing is correct (only
    slower, as each switch between requests re-feeds the draft)."""
    if isinstance(proposer, DraftModelProposer):
        return lambda: DraftModelProposer(proposer.model, proposer.vocabulary)
    if isinstance(proposer, PromptLookupProposer):
        return lambda: PromptLookupProposer(proposer.max_ngram, proposer.min_ngram, proposer.branches)
    if isinstance(proposer, SuffixProposer | HybridProposer):
        return proposer.fork  # one history for every request (request scope: the prototype does not remember)
    return lambda: proposer
