"""Tiny random models built in-process (no downloads), shared by the core test suite.

The models are 2-layer Llamas with peaked next-token distributions (the LM head is scaled up), so that
distribution tests have power. ``eos_token_id`` is None by default: a random model would otherwise stop
at whichever id was chosen and the exact-distribution tests would have to model EOS too; tests that need
an EOS set one on a copy of the ``LoadedModel`` (``with_eos``).

Drafts are the target with seeded Gaussian noise added to every weight: a different model (its own seed)
that agrees with the target often but not always, so both the accept and the reject paths run a lot.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import specdecode as sd
from specdecode.choices import as_choices

torch.set_num_threads(1)  # one core a test: `pytest -n auto` (pytest-xdist) runs one worker a core

# Rich wraps at the console's width, read from COLUMNS (and LINES) when a console is made, so an assertion on a
# phrase printed next to a tmp path failed once the path grew (pytest-99 -> pytest-100). The command modules'
# shared console is made when a test module imports them, and pytest-xdist starts its workers with COLUMNS=80 and
# LINES=24, which would fix it at 80 columns: every console made from here on is 400 columns wide.
os.environ["COLUMNS"] = "400"
os.environ.pop("LINES", None)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's default): one worker per core this process may use (each test runs on one torch
    thread), and at most one per 4 GiB of memory (a worker peaked at 2.6 GiB: BENCHMARKS.md, "CI's suite in two
    workers")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores, memory // (4 << 30)))


SMALL_VOCAB = 16
LARGE_VOCAB = 64


def tiny_llama(vocab_size: int, seed: int, logit_scale: float = 3.0, num_layers: int = 2) -> LlamaForCausalLM:
    """A random 2-layer Llama (hidden 32) whose logits are scaled by ``logit_scale`` (entropy ≈ 1.3 nats)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = randomized(LlamaForCausalLM(config).eval(), seed, weight_std=0.2)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


def train_word_head(target: sd.LoadedModel, words: list[str], tmp_path_factory, name: str):
    """An EAGLE head trained briefly for ``target`` (a word-tokenizer model) on 16 of its own sampled
    continuations, drafting over the 56 ids it predicted most; returns the head's folder."""
    from specdecode.training.train import TrainSettings, train_head

    corpus = tmp_path_factory.mktemp(f"{name}-corpus")
    generator = torch.Generator().manual_seed(3)
    for i in range(16):
        prompt = torch.randint(0, target.vocab_size, (3,), generator=generator).tolist()
        out = sd.autoregressive_generate(target, prompt, sd.SamplingParams(temperature=0.7, max_new_tokens=45, seed=i))
        (corpus / f"{i}.txt").write_text(" ".join(words[t] for t in prompt + out.token_ids))
    settings = TrainSettings(
        data=str(corpus), held_out=2, max_length=48, batch_tokens=96, epochs=4, lr=3e-3, warmup_steps=2,
        draft_vocab=56, extract_dtype="float32",
    )  # fmt: skip
    folder = tmp_path_factory.mktemp(name) / "head"
    train_head(target, settings, folder)
    return folder


def randomized(model: LlamaForCausalLM, seed: int, weight_std: float) -> LlamaForCausalLM:
    """``model`` with weights N(0, weight_std²) and norm scales U(0.5, 1.5), drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            else:
                param.copy_(weight_std * torch.randn(param.shape, generator=generator))
    return model


def quantizable_llama(
    vocab_size: int, seed: int, hidden_size: int = 128, weight_std: float | None = None
) -> LlamaForCausalLM:
    """A random 2-layer Llama whose layer sizes suit every weight format (int4 packs rows in blocks of 64):
    MLP twice as wide as ``hidden_size``; weights N(0, weight_std²) and norms U(0.5, 1.5) when ``weight_std``
    is given, else transformers' own initialisation (seeded)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return model if weight_std is None else randomized(model, seed, weight_std)


def perturbed(model: LlamaForCausalLM, seed: int, noise: float) -> LlamaForCausalLM:
    """A copy of ``model`` with N(0, (noise·std(W))²) added to every weight W: a related but different draft."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    return draft


def with_eos(model: sd.LoadedModel, *eos_ids: int) -> sd.LoadedModel:
    """The same model and weights, ending generation at ``eos_ids``."""
    return dataclasses.replace(model, eos_token_ids=frozenset(eos_ids))


def word_tokenizer(words: list[str], eos: str | None = None) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer whose id i is ``words[i]`` (decode joins tokens with spaces)."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0], eos_token=eos)


def write_chats(path, questions: list[str]):
    """A JSONL file of one-turn chats (each question with a placeholder answer, "w1"), as make-data reads them."""
    lines = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "w1"}]} for q in questions]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def chisquare_pvalue(counts, probs) -> float:
    """Chi-square goodness of fit of ``counts`` to ``probs`` (normalised); cells with expected count < 5 pooled.

    An outcome the law gives probability 0 fails at once.
    """
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    probs = probs / probs.sum()
    assert counts[probs == 0].sum() == 0, "an outcome the target gives probability 0 occurred"
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def resample_from_target(target_probs, draft_probs, draft_tokens, generator):
    """A WRONG verifier (the negative control): the min(1, p/q) test, but a rejection resamples from p
    instead of the residual norm(max(0, p − q))."""
    k = int(draft_tokens.shape[0])
    for i in range(k):
        p = float(target_probs[i, draft_tokens[i]])
        q = 1.0 if draft_probs is None else float(draft_probs[i, draft_tokens[i]])
        if not float(torch.rand((), dtype=torch.float64, generator=generator)) < p / q:
            return i, int(torch.multinomial(target_probs[i].double(), 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k].double(), 1, generator=generator))


@pytest.fixture(scope="session", params=["native", "transformers"])
def backend(request) -> str:
    """Every test on the tiny models runs on both runners: ours (native) and transformers'."""
    return request.param


@pytest.fixture(scope="session")
def small_target(backend: str) -> sd.LoadedModel:
    """Vocabulary 16: small enough to enumerate the joint law of two tokens (256 cells)."""
    return sd.load_model(tiny_llama(SMALL_VOCAB, seed=0), backend=backend)


@pytest.fixture(scope="session")
def small_draft(small_target: sd.LoadedModel, backend: str) -> sd.LoadedModel:
    """The small target plus strong noise: per-token acceptance ≈ 0.5 at temperature 1."""
    return sd.load_model(perturbed(small_target.model, seed=1, noise=0.15), backend=backend)


@pytest.fixture(scope="session")
def large_target(backend: str) -> sd.LoadedModel:
    """Vocabulary 64, for greedy identity over longer outputs."""
    return sd.load_model(tiny_llama(LARGE_VOCAB, seed=10), backend=backend)


@pytest.fixture(scope="session")
def large_draft(large_target: sd.LoadedModel, backend: str) -> sd.LoadedModel:
    """The large target plus mild noise: its greedy guesses are right about half the time."""
    return sd.load_model(perturbed(large_target.model, seed=11, noise=0.06), backend=backend)


# ------------------------------------------------------------------------------------------- token trees


def random_tables(depth: int, vocab_size: int, seed: int, concentration: float = 0.5) -> torch.Tensor:
    """``[depth, V, V]`` Dirichlet rows: ``table[d, t]`` is a distribution over the children of token t at depth d."""
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.dirichlet([concentration] * vocab_size, size=(depth, vocab_size)), dtype=torch.float64)


def draw_tree(
    widths: tuple[int, ...], table: torch.Tensor, root_token: int, generator: torch.Generator, sampled: bool = True
) -> sd.Draft:
    """A token tree in breadth-first order, ``widths[d]`` children per node at depth d (the root is depth 0).

    The children of a node whose token is t come from q = ``table[d, t]``: drawn without replacement, in
    order (``sampled``: probs = q), or q's most probable tokens (deterministic: probs None).
    """
    tokens: list[int] = []
    parents: list[int] = []
    rows: list[torch.Tensor] = []
    level = [(-1, root_token)]
    for depth, width in enumerate(widths):
        below = []
        for parent, token in level:
            q = table[depth, token]
            if sampled:
                left, drawn = q.clone(), []
                for _ in range(width):
                    drawn.append(as_choices(generator).draw(left, emitted=False))
                    left[drawn[-1]] = 0.0
            else:
                drawn = torch.sort(q, descending=True, stable=True).indices[:width].tolist()
            for x in drawn:
                below.append((len(tokens), x))
                tokens.append(x)
                parents.append(parent)
                rows.append(q)
        level = below
    return sd.Draft(
        torch.tensor(tokens, dtype=torch.int64),
        torch.stack(rows) if sampled and rows else None,
        torch.tensor(parents, dtype=torch.int64),
    )


class TreeProposer:
    """Drafts a random token tree of a fixed shape (``draw_tree`` over ``table`` ``[depth, V, V]``) after the
    context's newest token; a shape deeper than the round's k is cut to depth k. The table sees only the
    parent token, not the whole context, which the rule allows."""

    def __init__(self, widths: tuple[int, ...], table: torch.Tensor, sampled: bool = True) -> None:
        self.widths = widths
        self.sampled = sampled
        self.table = table

    def propose(self, context, k, params, generator):
        return draw_tree(self.widths[:k], self.table, context[-1], generator, self.sampled)


def biased_tree_sample(
    target_probs, draft_probs, draft_tokens, parents, generator, *, update_residual=True, remove_tried=True
):
    """A WRONG tree rule (negative controls): recursive rejection over siblings with one step left out —
    the residual not updated after a rejected sibling, or tried siblings not removed from q."""
    from specdecode.tree import children

    kids = children(parents)
    accepted, row = [], 0
    while True:
        residual = target_probs[row].double()
        q = None if draft_probs is None or not kids[row] else draft_probs[kids[row][0]].double().clone()
        for node in kids[row]:
            x = int(draft_tokens[node])
            q_x = 1.0 if q is None else float(q[x])
            if q_x > 0 and float(torch.rand((), dtype=torch.float64, generator=generator)) < float(residual[x]) / q_x:
                accepted.append(node)
                row = node + 1
                break
            if update_residual:
                removed = torch.nn.functional.one_hot(torch.tensor(x), len(residual)) if q is None else q
                left = (residual - removed).clamp_min(0.0)
                residual = left / left.sum() if left.sum() > 1e-12 else residual
            if q is not None and remove_tried:
                q[x] = 0.0
                q = q / q.sum() if q.sum() > 0 else q
        else:
            return accepted, int(torch.multinomial(residual, 1, generator=generator))
