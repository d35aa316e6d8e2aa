"""Random token trees: Dirichlet tables, a tree drawn from them, and a proposer that drafts such trees."""

from __future__ import annotations

import numpy as np
import torch

import specdecode as sd
from helpers.models import SMALL_VOCAB
from specdecode.exactness.check import first_token_law
from specdecode.sampling.choices import as_choices


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


def informed_table(target: sd.LoadedModel, widths: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    """Draft tables half the target's law after EXACT_PROMPT (depth 0) or EXACT_PROMPT + [t] (depth 1, parent
    t), half random: close enough for many acceptances, far enough for many rejections."""
    table = random_tables(len(widths), SMALL_VOCAB, seed)
    table[0, EXACT_PROMPT[-1]] = (table[0, EXACT_PROMPT[-1]] + first_token_law(target, EXACT_PROMPT, T1)) / 2
    for parent in range(SMALL_VOCAB if len(widths) > 1 else 0):
        law = first_token_law(target, [*EXACT_PROMPT, parent], T1)
        table[1, parent] = (table[1, parent] + law) / 2
    return table


EXACT_PROMPT = [1, 2, 3]

T1 = sd.SamplingParams(temperature=1.0)
