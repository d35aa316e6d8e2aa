"""The decoding methods a bench compares: ours (plain, speculative) and transformers' ``generate``.

llama.cpp's methods (an optional peer, not a dependency) live in ``llamacpp.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..engine.decoder import SpeculativeDecoder, autoregressive_generate
from ..engine.stats import DecodeStats
from ..factory import lookup_hybrid
from ..models.loaded import LoadedModel
from ..proposers import (
    DraftModelProposer,
    EagleProposer,
    HybridProposer,
    MedusaProposer,
    PromptLookupProposer,
    Proposer,
    SuffixHistory,
    SuffixProposer,
)
from ..proposers.layer_skip import for_transformers, self_draft_model
from ..sampling.params import SamplingParams

PLAIN = "ours:plain"
HF_PLAIN = "hf:plain"
HF_PROMPT_LOOKUP_TOKENS = 10
PROPOSERS = ("lookup", "draft", "eagle", "medusa", "suffix", "eagle+suffix", "eagle+lookup")


@dataclass(frozen=True)
class MethodSpec:
    """What a method is, for the report: its family, proposer, gamma and the target weights it ran on."""

    name: str
    family: str  # "ours", "transformers" or "llama.cpp"
    proposer: str | None = None
    gamma: int | None = None
    description: str = ""
    quantization: str | None = None  # the weights, as LoadedModel.quantization: None (dense), "gguf", "int8", "int4"
    setting: str | None = None  # ours only: the --quantization entry, named in the method when several are compared
    mode: str = "exact"  # ours: the verification mode; "reproducible" promises plain sampling's tokens per seed

    @property
    def weights(self) -> str:
        return self.quantization or "dense"

    @property
    def ours_plain(self) -> bool:
        return self.family == "ours" and self.proposer is None


@dataclass
class Generation:
    """One timed generation: new token ids (EOS included if it ended), wall seconds, our stats if any."""

    token_ids: list[int]
    seconds: float
    stats: DecodeStats | None


class Method:
    """A method bound to a loaded target; ``start()`` gives a fresh per-question session (a fresh proposer; a
    speculative method's decoder keeps what it measured, its costs and ``gamma="auto"``'s acceptance memory, as a
    long-lived decoder or a server does)."""

    def __init__(
        self,
        spec: MethodSpec,
        run: Callable[[list[int], SamplingParams], Generation],
        start: Callable[[], None] | None = None,
        forget: Callable[[], None] | None = None,
    ) -> None:
        self.spec = spec
        self._run = run
        self._start = start
        self._forget = forget

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self) -> None:
        """Reset per-question state (untimed): a fresh proposer, so no cache or text leaks between questions."""
        if self._start is not None:
            self._start()

    def forget(self) -> None:
        """Drop what a method remembers across questions (suffix decoding's history), e.g. the warm-up's."""
        if self._forget is not None:
            self._forget()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return self._run(prompt_ids, params)


def _suffix(setting: str | None) -> str:
    return "" if setting is None else f"@{setting}"


def _ours_plain(target: LoadedModel, setting: str | None = None) -> Method:
    state: dict = {}

    def start() -> None:  # untimed, as the speculative methods build their decoder (and its runner) untimed
        state["runner"] = target.new_runner()

    def run(prompt_ids: list[int], params: SamplingParams) -> Generation:
        if "runner" not in state:
            start()
        t0 = time.perf_counter()
        out = autoregressive_generate(target, prompt_ids, params, runner=state["runner"])
        return Generation(out.token_ids, time.perf_counter() - t0, out.stats)

    spec = MethodSpec(
        PLAIN + _suffix(setting),
        "ours",
        description="our autoregressive decode",
        quantization=target.quantization,
        setting=setting,
    )
    return Method(spec, run, start)


def _ours_speculative(
    target: LoadedModel,
    proposer: str,
    make: Callable[[], Proposer],
    gamma: int | str,
    mode: str = "exact",
    setting: str | None = None,
    forget: Callable[[], None] | None = None,
) -> Method:
    state: dict[str, SpeculativeDecoder] = {}

    def start() -> None:  # a fresh proposer per question; the decoder's measured costs and memory kept, as a server's
        if "decoder" in state:
            state["decoder"].use_proposer(make())
        else:
            state["decoder"] = SpeculativeDecoder(target, make(), gamma, mode=mode)

    def run(prompt_ids: list[int], params: SamplingParams) -> Generation:
        if "decoder" not in state:
            start()
        t0 = time.perf_counter()
        out = state["decoder"].generate(prompt_ids, params)
        return Generation(out.token_ids, time.perf_counter() - t0, out.stats)

    suffix = "" if mode == "exact" else f":{mode}"
    spec = MethodSpec(
        f"ours:{proposer}:g{gamma}{suffix}{_suffix(setting)}",
        "ours",
        proposer,
        gamma if isinstance(gamma, int) else None,
        f"our speculative decoding, {proposer} proposer, gamma={gamma}, mode={mode}",
        target.quantization,
        setting,
        mode,
    )
    return Method(spec, run, start, forget)


def _hf_generate(
    target: LoadedModel, name: str, description: str, proposer: str | None = None, gamma: int | None = None, **extra
) -> Method:
    spec = MethodSpec(name, "transformers", proposer, gamma, description, target.quantization)
    model = target.model
    eos = sorted(target.eos_token_ids) or None

    @torch.inference_mode()
    def run(prompt_ids: list[int], params: SamplingParams) -> Generation:
        ids = torch.tensor([prompt_ids], dtype=torch.int64)
        sampling = (
            {"do_sample": False}
            if params.greedy
            else {
                "do_sample": True,
                "temperature": params.temperature,
                "top_k": params.top_k,
                "top_p": params.top_p,
            }
        )
        if not params.greedy and params.seed is not None:
            torch.manual_seed(params.seed)
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=params.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
            **sampling,
            **extra,
        )
        seconds = time.perf_counter() - t0
        return Generation(out[0, ids.shape[1] :].tolist(), seconds, None)

    return Method(spec, run)


def draft_proposer_factory(
    target: LoadedModel, draft: str | LoadedModel, dtype: str | torch.dtype = torch.float32
) -> tuple[Callable[[], Proposer], LoadedModel]:
    """A factory of fresh draft proposers and the draft's LoadedModel; ``self:N`` / ``skip:...`` = views of the
    target without some of its layers."""
    if isinstance(draft, str):
        own = self_draft_model(target, draft)
        if own is not None:
            return (lambda: DraftModelProposer(own)), own
    from ..models.loading.loader import load_model

    loaded = draft if isinstance(draft, LoadedModel) else load_model(draft, dtype=dtype)
    return (lambda: DraftModelProposer(loaded)), loaded


def build_methods(
    target: LoadedModel,
    proposers: Sequence[str] = ("lookup",),
    gammas: Sequence[int | str] = (4,),
    draft: str | LoadedModel | None = None,
    transformers: bool = True,
    dtype: str | torch.dtype = torch.float32,
    modes: Sequence[str] = ("exact",),
    setting: str | None = None,
    head: str | None = None,
    tree_nodes: Sequence[int] = (),
    heads: str | None = None,
) -> list[Method]:
    """Ours plain; ours speculative for each proposer × gamma; transformers plain / prompt lookup / assisted.

    The ``draft`` proposer and transformers' assisted generation need ``draft``; without it they are left out.
    ``eagle`` uses ``head`` (default: the head shipped for the target), one method per ``tree_nodes`` entry
    (0 = a chain; none given: the proposer's default tree), named ``eagle``, ``eagle-chain``, ``eagle-t8``;
    ``medusa`` likewise, with the Medusa heads in ``heads`` (default: the shipped ones).
    ``setting`` names our methods' target weights (``ours:plain@int4``) when several are compared.
    """
    unknown = [p for p in proposers if p not in PROPOSERS]
    if unknown:
        raise ValueError(f"unknown proposer {unknown[0]!r}; choose from {', '.join(PROPOSERS)}")
    bad = [g for g in gammas if g != "auto" and (isinstance(g, bool) or not isinstance(g, int) or g < 1)]
    if bad:
        raise ValueError(f"gamma must be an integer >= 1 or auto, got {bad[0]!r}")
    unknown_modes = [m for m in modes if m not in ("exact", "reproducible")]
    if unknown_modes:
        raise ValueError(f"unknown mode {unknown_modes[0]!r}; choose from exact, reproducible")
    make_draft, draft_model = (None, None) if draft is None else draft_proposer_factory(target, draft, dtype)
    methods = [_ours_plain(target, setting)]
    makers: list[tuple[str, Callable[[], Proposer]]] = []
    for proposer in proposers:
        if proposer == "draft" and make_draft is not None:
            makers.append((proposer, make_draft))
        elif proposer == "lookup":
            makers.append((proposer, PromptLookupProposer))
        elif proposer == "eagle":
            makers += _eagle_makers(target, head, tree_nodes)
        elif proposer == "eagle+lookup":
            makers += [
                (f"{name}+lookup", _lookup_hybrid_maker(make)) for name, make in _eagle_makers(target, head, tree_nodes)
            ]
        elif proposer == "medusa":
            makers += [(_tree_name("medusa", n), _medusa_factory(target, heads, n)) for n in tree_nodes or [None]]
        elif proposer in ("suffix", "eagle+suffix"):
            for name, make_model in [("", None)] if proposer == "suffix" else _eagle_makers(target, head, tree_nodes):
                for m in modes:
                    for g in gammas:
                        make, forget = suffix_factory()
                        if make_model is not None:
                            make = _hybrid_maker(make_model, make)
                        label = f"{name}+suffix" if name else proposer
                        methods.append(_ours_speculative(target, label, make, g, m, setting, forget))
    for name, make in makers:
        methods += [_ours_speculative(target, name, make, g, m, setting) for m in modes for g in gammas]
    if transformers:
        methods += transformers_methods(target, draft_model, dtype)
    return methods


def draft_method(target: LoadedModel, label: str, draft: LoadedModel, gamma: int) -> Method:
    """Ours speculative with ``draft`` as the draft model (a fresh proposer per run), named ``ours:LABEL:gG``."""
    return _ours_speculative(target, label, lambda: DraftModelProposer(draft), gamma)


def suffix_factory() -> tuple[Callable[[], Proposer], Callable[[], None]]:
    """Suffix proposers that share one history across a run's questions (each remembers the earlier ones'
    prompts and answers, as a server would), and ``forget``, which empties it (after the warm-up)."""
    state = {"history": SuffixHistory()}

    def forget() -> None:
        state["history"] = SuffixHistory()

    return (lambda: SuffixProposer(state["history"])), forget


def _tree_name(proposer: str, tree_nodes: int | None) -> str:
    return proposer if tree_nodes is None else f"{proposer}-chain" if tree_nodes == 0 else f"{proposer}-t{tree_nodes}"


def _tree_shape(tree_nodes: int | None) -> dict[str, int | None]:
    if tree_nodes is not None and tree_nodes < 0:
        raise ValueError(f"tree sizes must be >= 0 (0 = a chain), got {tree_nodes}")
    return {} if tree_nodes is None else {"tree_nodes": tree_nodes or None}


def _eagle_makers(
    target: LoadedModel, head: str | None, tree_nodes: Sequence[int]
) -> list[tuple[str, Callable[[], Proposer]]]:
    return [(_tree_name("eagle", n), _eagle_factory(target, head, n)) for n in tree_nodes or [None]]


def _hybrid_maker(make_model: Callable[[], Proposer], make_copier: Callable[[], Proposer]) -> Callable[[], Proposer]:
    """Fresh ``HybridProposer``s: a new model proposer each, the copier over the run's one history."""
    return lambda: HybridProposer(make_model(), make_copier())  # type: ignore[arg-type]


def _lookup_hybrid_maker(make_model: Callable[[], Proposer]) -> Callable[[], Proposer]:
    """Fresh ``MODEL+lookup`` hybrids (``factory.lookup_hybrid``), a new model proposer each."""
    return lambda: lookup_hybrid(make_model())


def _eagle_factory(target: LoadedModel, head: str | None, tree_nodes: int | None) -> Callable[[], Proposer]:
    shape = _tree_shape(tree_nodes)
    EagleProposer(target, head=head)  # fail early: no head for this target, or a head for another one
    return lambda: EagleProposer(target, head=head, **shape)


def _medusa_factory(target: LoadedModel, heads: str | None, tree_nodes: int | None) -> Callable[[], Proposer]:
    shape = _tree_shape(tree_nodes)
    MedusaProposer(target, heads=heads, **shape)  # fail early: no heads for this target, or for another one
    return lambda: MedusaProposer(target, heads=heads, **shape)


def transformers_methods(
    target: LoadedModel, draft: str | LoadedModel | None = None, dtype: str | torch.dtype = torch.float32
) -> list[Method]:
    """transformers' generate(): plain, prompt lookup, and assisted generation when there is a ``draft``."""
    methods = [
        _hf_generate(target, HF_PLAIN, "transformers generate()"),
        _hf_generate(
            target,
            f"hf:lookup{HF_PROMPT_LOOKUP_TOKENS}",
            f"transformers generate(prompt_lookup_num_tokens={HF_PROMPT_LOOKUP_TOKENS})",
            "lookup",
            HF_PROMPT_LOOKUP_TOKENS,
            prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS,
        ),
    ]
    if draft is not None:
        _, draft_model = draft_proposer_factory(target, draft, dtype)
        draft_model = for_transformers(draft_model)
        methods.append(
            _hf_generate(
                target,
                "hf:assisted",
                "transformers generate(assistant_model=draft)",
                "draft",
                assistant_model=draft_model.model,
            )
        )
    return methods
