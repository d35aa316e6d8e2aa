"""A proposer's guesses: the data the verifier and the token-tree code read (below the proposers that make it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Draft:
    """Guessed tokens ``[n]`` (int64), the distributions they were drawn from ``[n, V]``, and their tree.

    ``probs`` is None for a deterministic proposer: a point mass on each token (q_i(x_i) = 1).
    ``parents`` is None for a chain (node i follows node i-1). For a token tree it is int64 ``[n]`` with
    ``parents[i] < i`` (topological order) and -1 for a child of the context's newest token. Siblings share
    one draft distribution: ``probs[i]`` is the distribution node i and its siblings were drawn from, without
    replacement, in index order.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_tree(self) -> bool:
        """True when some node branches (a chain given with explicit parents is still a chain)."""
        if self.parents is None:
            return False
        return bool((self.parents != torch.arange(-1, len(self) - 1)).any())

    def truncated(self, k: int) -> Draft:
        """The first ``k`` guesses (for a tree: the first ``k`` nodes, still a tree since parents precede)."""
        return Draft(
            self.tokens[:k],
            None if self.probs is None else self.probs[:k],
            None if self.parents is None else self.parents[:k],
        )

    def after_forced(self, forced: list[int]) -> Draft:
        """This draft (a chain or a tree, guessed after ``forced``) behind the chain of ``forced`` tokens, each a point
        mass: a token a grammar forces is its row's only allowed token, so the target's masked law is that point
        mass and it is always accepted."""
        if not forced:
            return self
        f = len(forced)
        tokens = torch.cat([torch.tensor(forced, dtype=torch.int64), self.tokens])
        probs = None
        if self.probs is not None:
            probs = torch.cat(
                [torch.nn.functional.one_hot(tokens[:f], self.probs.shape[-1]).to(self.probs), self.probs]
            )
        parents = None
        if self.parents is not None:
            shifted = torch.where(self.parents < 0, f - 1, self.parents + f)
            parents = torch.cat([torch.arange(-1, f - 1, dtype=torch.int64), shifted])
        return Draft(tokens, probs, parents)


EMPTY_DRAFT = Draft(torch.zeros(0, dtype=torch.int64))
