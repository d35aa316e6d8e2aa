"""Many prompts answered together in one left-padded batch: the target's own answers on a GPU.

Our engine runs one forward per request on the transformers runner, which leaves a GPU idle between its tiny
kernels; a GPU answers fastest with every prompt of a batch in one tensor. Prompts are left-padded to the longest,
the padding masked out of attention, each row's positions counted from its first real token (RoPE then sees
what an unpadded run sees); every step feeds each row's newest token. A row stops at an end-of-sequence id or
``max_new_tokens``; a finished row leaves the batch (its KV cache rows dropped), so one long answer does not keep
the finished rows computing, and the batch stops when every row has. Rows see the same weights as a lone run, but
other reduction shapes, so an answer can differ from the engine's where two tokens nearly tie (greedy on a GPU: no
bitwise promise). Sampling (temperature > 0) draws every live row from one generator seeded per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.transformers_runner import cache_keyword
from ..sampling.params import SamplingParams
from ..sampling.probs import greedy_tokens, probs_from_logits


@dataclass(frozen=True)
class PaddedAnswer:
    """One row's generated ids (the end-of-sequence id included, as the engine returns them) and why it ended."""

    token_ids: list[int]
    finish_reason: str  # "eos" or "length"


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], attention mask [B, L]) with each prompt right-aligned, padding on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def answer_padded(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_ids: frozenset[int],
    vocab_size: int,
    pad_id: int = 0,
) -> list[PaddedAnswer]:
    """Answers to ``prompts`` (token ids) from ``model`` (a transformers causal LM, wherever its weights are),
    decoded together: greedy at temperature 0, else sampled per ``params`` with a generator seeded by
    ``params.seed``. Logits past ``vocab_size`` (a padded LM head) are never chosen."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("answer_padded needs at least one prompt, none of them empty")
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(params.seed if params.seed is not None else 0)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.int64, device=device)
    rows = torch.arange(len(prompts), device=device)  # the prompt each live row answers
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, their chosen ids) a step
    past = None
    for _ in range(params.max_new_tokens):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{cache_keyword(model): past},
            logits_to_keep=1,  # the prompt rows' logits would be rows x length x vocabulary floats
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :vocab_size].float()
        if generator is None:
            chosen = greedy_tokens(logits)
        else:
            probs = probs_from_logits(logits, params)
            chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        steps.append((rows, chosen))
        live = ~torch.isin(chosen, eos)
        if not bool(live.all()):  # finished rows leave the batch, their cache with them
            if not bool(live.any()):
                break
            keep = live.nonzero().squeeze(1)
            past.batch_select_indices(keep)
            rows, chosen, mask, positions = rows[keep], chosen[keep], mask[keep], positions[keep]
        ids = chosen[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
    generated: list[list[int]] = [[] for _ in prompts]
    for step_rows, step_chosen in steps:
        for row, token in zip(step_rows.tolist(), step_chosen.tolist(), strict=True):
            generated[row].append(token)
    return [PaddedAnswer(row, "eos" if row and row[-1] in eos_ids else "length") for row in generated]
