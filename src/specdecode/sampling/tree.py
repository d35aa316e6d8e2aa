"""Token-tree structure: the rows, depths, attention mask and pruning of a drafted tree.

A tree of n nodes is given by ``parents`` (int64 ``[n]``, ``parents[i] < i``, −1 for a child of the context's
newest token, the root). The target scores it in one pass over n + 1 rows: row 0 is the root, row i + 1 is
node i, so the row of a node's parent is ``parents[i] + 1``.
"""

from __future__ import annotations

import dataclasses

import torch

from .draft import Draft


def children(parents: torch.Tensor) -> list[list[int]]:
    """Per row (0 = root, i + 1 = node i), that row's child nodes in index order (sibling order)."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents.tolist()):
        if not -1 <= parent < node:
            raise ValueError(f"tree parents must satisfy -1 <= parents[i] < i; node {node} has parent {parent}")
        kids[parent + 1].append(node)
    return kids


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node, int64 ``[n]``: 1 for a child of the root, depth(parent) + 1 otherwise."""
    out = torch.zeros(len(parents), dtype=torch.int64)
    for node, parent in enumerate(parents.tolist()):
        out[node] = 1 if parent < 0 else out[parent] + 1
    return out


def attention_mask(parents: torch.Tensor, cached: int) -> torch.Tensor:
    """Bool ``[n+1, cached+n+1]`` (True = may attend): every row sees the ``cached`` entries, the root and its
    own ancestors and itself, so each row's result is that of the chain along its branch."""
    n = len(parents)
    tree = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    tree[0, 0] = True
    for node, parent in enumerate(parents.tolist()):
        tree[node + 1] = tree[parent + 1]
        tree[node + 1, node + 1] = True
    return torch.cat([torch.ones(n + 1, cached, dtype=torch.bool), tree], dim=1)


def prune_depth(draft: Draft, max_depth: int) -> Draft:
    """The nodes of ``draft`` at depth ≤ ``max_depth`` (ancestors of a kept node are kept), renumbered."""
    node_depths = depths(draft.parents)
    kept = torch.nonzero(node_depths <= max_depth).squeeze(1)
    if len(kept) == len(draft):
        return draft
    renumber = torch.full((len(draft) + 1,), -1, dtype=torch.int64)  # index parent + 1; the root stays −1
    renumber[kept + 1] = torch.arange(len(kept))
    return dataclasses.replace(
        draft,
        tokens=draft.tokens[kept],
        probs=None if draft.probs is None else draft.probs[kept],
        parents=renumber[draft.parents[kept] + 1],
    )
