"""How far stored weights move a model from its dense float32 self: agreement, perplexity, KL, bytes.

Text: held-out prose (``held_out.txt``, written for this check: in no training, tuning or benchmark set), read
raw (no chat template) in chunks of ``CHUNK`` tokens, each from an empty cache, teacher-forced through every
model. Per predicted position: does the setting's argmax equal the float32 model's; the NLL of the actual next
token; KL(float32 ‖ setting). Greedy: the float32 model's greedy answers to ``PROMPTS`` (chat template), teacher-
forced through every model; the share of answer positions where the argmaxes agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F

from ..engine.decoder import autoregressive_generate
from ..models.loaded import LoadedModel
from ..models.memory import held_weight_bytes
from ..sampling.params import SamplingParams

REFERENCE = "float32"
CHUNK = 512
GREEDY_TOKENS = 128
PROMPTS = (
    "Explain in a short paragraph why the sky looks blue during the day and red at sunset.",
    "Write a Python function that checks whether a string is a palindrome, ignoring spaces and capital letters.",
    "Give me three tips for keeping houseplants healthy through the winter.",
    "Write a four-line poem about a cat watching the rain from a window.",
    "What is the difference between weather and climate? Answer in two or three sentences.",
)


def load_settings(target: str, settings: Sequence[str], group_size: int) -> tuple[LoadedModel, dict[str, LoadedModel]]:
    """``target`` dense (the float32 reference where the file holds float32 or quantized weights) and in each of the
    weight ``settings`` (the CLI's words), each refused in one line naming the setting."""
    from .. import factory
    from ..errors import SpecDecodeError

    models = {}
    for setting in ("none", *settings):
        try:
            models[setting] = factory.load(target, "auto", setting, group_size)
        except (OSError, SpecDecodeError) as e:
            raise ValueError(f"cannot load model {target!r}: {e}") from None
        except ValueError as e:
            raise ValueError(f"--quantization {setting}: {e}" if setting != "none" else str(e)) from None
    reference = models.pop("none") if "none" not in settings else models["none"]
    return reference, {s: models[s] for s in settings}


def held_out_text() -> str:
    """The shipped held-out prose (about 3,000 words)."""
    return resources.files("specdecode.bench").joinpath("held_out.txt").read_text(encoding="utf-8")


def text_chunks(ids: Sequence[int], chunk: int = CHUNK) -> list[list[int]]:
    """Consecutive pieces of ``chunk`` ids; a last piece of one id (nothing to predict) is dropped."""
    if chunk < 2:
        raise ValueError(f"chunks need at least 2 tokens, got {chunk}")
    pieces = [list(ids[start : start + chunk]) for start in range(0, len(ids), chunk)]
    return [piece for piece in pieces if len(piece) >= 2]


def compare_positions(
    reference: torch.Tensor, logits: torch.Tensor, next_tokens: torch.Tensor
) -> tuple[int, float, float]:
    """Over rows of [n, V] logits: #(argmax = reference argmax), Σ −log p(next token), Σ KL(reference ‖ logits)."""
    reference_log = torch.log_softmax(reference.double(), dim=-1)
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    agreed = int((logits.argmax(-1) == reference.argmax(-1)).sum())
    nll = -float(log_probs.gather(-1, next_tokens[:, None]).sum())
    kl = float(F.kl_div(log_probs, reference_log, reduction="sum", log_target=True))
    return agreed, nll, kl


@dataclass(frozen=True)
class SettingQuality:
    """One way of storing the weights, measured against the dense float32 model."""

    name: str
    weight_bytes: int
    positions: int  # predicted text positions
    agreement: float  # share of text positions whose argmax is the float32 model's
    perplexity: float  # exp(mean NLL of the text's next tokens)
    kl: float  # mean KL(float32 ‖ this setting) per text position, nats
    greedy_positions: int
    greedy_agreement: float  # share of greedy-answer positions whose argmax is the float32 model's


@dataclass(frozen=True)
class QualityReport:
    reference: SettingQuality  # the float32 model itself: agreement 1, KL 0
    settings: tuple[SettingQuality, ...]
    text_tokens: int
    chunk: int
    greedy_tokens: int


@dataclass
class _Tally:
    positions: int = 0
    agreed: int = 0
    nll: float = 0.0
    kl: float = 0.0


def _logits(model_runner, tokens: torch.Tensor) -> torch.Tensor:
    model_runner.reset()
    return model_runner.forward(tokens)


def measure_quality(
    reference: LoadedModel,
    settings: Mapping[str, LoadedModel],
    text_ids: Sequence[int],
    prompts: Sequence[list[int]],
    chunk: int = CHUNK,
    greedy_tokens: int = GREEDY_TOKENS,
    on_step: Callable[[str], None] | None = None,
) -> QualityReport:
    """Teacher-force ``text_ids`` (in chunks) and the reference's greedy answers to ``prompts`` through the
    reference and every setting; ``on_step`` is called after each forward pass or generation."""
    pieces = text_chunks(text_ids, chunk)
    if not pieces:
        raise ValueError("the text needs at least 2 tokens")
    if REFERENCE in settings:
        raise ValueError(f"{REFERENCE!r} names the reference: give the settings other names")
    models = {REFERENCE: reference, **settings}
    runners = {name: model.new_runner() for name, model in models.items()}
    text = {name: _Tally() for name in models}
    greedy = {name: _Tally() for name in models}
    step = on_step or (lambda _: None)
    for index, piece in enumerate(pieces):
        tokens = torch.tensor(piece, dtype=torch.int64)
        reference_logits = None
        for name, runner in runners.items():
            logits = _logits(runner, tokens[:-1])
            reference_logits = logits if reference_logits is None else reference_logits
            agreed, nll, kl = compare_positions(reference_logits, logits, tokens[1:])
            tally = text[name]
            tally.positions += len(piece) - 1
            tally.agreed += agreed
            tally.nll += nll
            tally.kl += kl
            step(f"text chunk {index + 1}/{len(pieces)}: {name}")
    params = SamplingParams(max_new_tokens=greedy_tokens)
    for index, prompt in enumerate(prompts):
        answer = autoregressive_generate(reference, prompt, params).token_ids
        step(f"prompt {index + 1}/{len(prompts)}: float32 greedy answer")
        sequence = torch.tensor(prompt + answer, dtype=torch.int64)
        reference_choice = None
        for name, runner in runners.items():
            choice = _logits(runner, sequence[:-1])[len(prompt) - 1 :].argmax(-1)
            reference_choice = choice if reference_choice is None else reference_choice
            greedy[name].positions += len(answer)
            greedy[name].agreed += int((choice == reference_choice).sum())
            step(f"prompt {index + 1}/{len(prompts)}: {name}")
    results = [
        SettingQuality(
            name=name,
            weight_bytes=held_weight_bytes(model.model)[1],
            positions=text[name].positions,
            agreement=text[name].agreed / text[name].positions,
            perplexity=math.exp(text[name].nll / text[name].positions),
            kl=text[name].kl / text[name].positions,
            greedy_positions=greedy[name].positions,
            greedy_agreement=greedy[name].agreed / greedy[name].positions if greedy[name].positions else math.nan,
        )
        for name, model in models.items()
    ]
    return QualityReport(results[0], tuple(results[1:]), len(text_ids), chunk, greedy_tokens)


def steps(text_tokens: int, settings: int, prompts: int, chunk: int = CHUNK) -> int:
    """How many times ``measure_quality`` calls ``on_step`` (for a progress bar)."""
    pieces = len(text_chunks(range(text_tokens), chunk))
    return (pieces + prompts) * (1 + settings) + prompts
