"""Where a head's held-out agreement comes from: all rows against answer rows, by position in the answer, and the
acceptance a γ1 chain would see on the same greedy text, on held-out chats and on unseen chat prompts.

    .venv/bin/python scripts/answer_rows_report.py --answers DIR/answers.jsonl --out DIR [--head shipped]

``--answers``: a make-data file whose first 32 chats in prompt order are the held-out ones (the target's greedy
answers). The unseen chat prompts (``docs/bench/eagle/unseen_chat.jsonl``) are answered here by the dense
float32 target, greedy, ``--new-tokens`` tokens. Everything is teacher-forced depth-1 top-1 of the head (its
drafting vocabulary) against the target's argmax over the whole vocabulary, as ``held_out_accuracy`` counts it.
The γ1 replay walks each answer from its second token (the first is the prefill's): a hit accepts the guess and
the target's next token, so the next guess is two tokens on; a miss moves one. On the target's own greedy text
this is what a γ1 chain accepts in generation. The figures go to ``DIR/answer_rows.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from compare_head_data import sorted_answers  # scripts/ is on sys.path when run as a script

import specdecode as sd
from specdecode.heads.answer_rows import answer_markers, answer_positions, answer_rows
from specdecode.heads.model import TargetParts, lm_head_rows, unrolled
from specdecode.heads.saved import load_head, shipped_head
from specdecode.heads.train import FeatureCache, TrainSettings, batch_tensors, read_samples

UNSEEN = Path(__file__).resolve().parent.parent / "docs" / "bench" / "eagle" / "unseen_chat.jsonl"
EDGES = [1, 16, 32, 64, 128, 192, 256, 384, 1 << 20]


def depth1_hits(
    head, parts, rows, cache, ids: list[int], key: str, sizes: list[int]
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """({N: hit [n] bool — row t's first guess from the first N ids of ``parts.draft_vocab`` is the target's argmax
    at t+1}, valid [n] bool)."""
    features, tokens, positions = batch_tensors(cache, key, [ids], [0])
    normed = F.rms_norm(features, (parts.hidden_size,), parts.norm_weight, parts.eps)
    wanted = (normed @ rows.T).argmax(-1).roll(-1)
    predicted, valid = unrolled(head, parts, features, tokens, positions, 1)[0]
    logits = parts.logits(predicted)
    return {n: parts.to_vocab(logits[:, :n].argmax(-1)) == wanted for n in sizes}, valid


def share(pair: list[int]) -> float:
    """hits / count, rounded (0 when nothing was counted)."""
    return round(pair[0] / max(pair[1], 1), 4)


def report(head, parts, rows, cache, sequences: list[list[int]], markers, first: int, sizes: list[int], decode) -> dict:
    """All rows / answer rows / prompt rows, by answer position, and over the first ``first`` answer tokens: the
    γ1 replay, answers with a code fence against the rest, and drafting from the first N ids for N in ``sizes``
    (the first is the head's own vocabulary, which every other figure uses)."""
    split = {"answer rows": [0, 0], "prompt rows of answered chats": [0, 0], "rows of chats with no answer": [0, 0]}
    by_position = [[0, 0] for _ in EDGES[:-1]]
    positions_hit = [0, 0]
    rounds = [0, 0]
    kinds = {"with code": [0, 0], "prose": [0, 0]}
    by_size = {n: [0, 0] for n in sizes}
    for i, ids in enumerate(sequences):
        hits, valid = depth1_hits(head, parts, rows, cache, ids, f"s{i}", sizes)
        hit = hits[sizes[0]]
        inside = answer_positions(ids, markers)
        counted = answer_rows(ids, markers)
        answered = bool(inside.any())
        for r in range(len(ids)):
            if not valid[r]:
                continue
            name = "answer rows" if counted[r] and answered else "prompt rows of answered chats"
            name = name if answered else "rows of chats with no answer"
            split[name][0] += int(hit[r])
            split[name][1] += 1
        if not answered:
            continue
        start = int(inside.nonzero()[0])
        agree = {}
        for q in range(start + 1, len(ids)):  # q: a guessed position; row q-2 guesses it
            if not (inside[q] and valid[q - 2]):
                continue
            k = q - start
            bucket = max(b for b in range(len(EDGES) - 1) if EDGES[b] <= k)
            by_position[bucket][0] += int(hit[q - 2])
            by_position[bucket][1] += 1
            if k < first:
                agree[q] = bool(hit[q - 2])
        positions_hit[0] += sum(agree.values())
        positions_hit[1] += len(agree)
        kind = kinds["with code" if "```" in decode(ids[start:]) else "prose"]
        kind[0] += sum(agree.values())
        kind[1] += len(agree)
        for n in sizes:
            by_size[n][0] += sum(int(hits[n][q - 2]) for q in agree)
            by_size[n][1] += len(agree)
        q = start + 1
        while q in agree:
            rounds[1] += 1
            rounds[0] += agree[q]
            q += 2 if agree[q] else 1
    total = [sum(v[0] for v in split.values()), sum(v[1] for v in split.values())]
    return {
        "rows": {"all rows": {"rows": total[1], "top1": share(total)}}
        | {name: {"rows": pair[1], "top1": share(pair)} for name, pair in split.items()},
        "by_answer_position": {
            f"{EDGES[b]}-{EDGES[b + 1] - 1}": {"rows": pair[1], "top1": share(pair)}
            for b, pair in enumerate(by_position)
            if pair[1]
        },
        f"first_{first}_answer_tokens": {
            "positions": positions_hit[1],
            "per_position_top1": share(positions_hit),
            "gamma1_rounds": rounds[1],
            "gamma1_accepted": share(rounds),
            "gamma1_tokens_per_pass": round(1 + rounds[0] / max(rounds[1], 1), 3),
            "by_kind": {name: {"positions": pair[1], "top1": share(pair)} for name, pair in kinds.items()},
            "by_drafting_ids": {str(n): share(pair) for n, pair in by_size.items()},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--head", default="shipped", help="a head's folder, or shipped")
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128, help="unseen chat answers, and the replay's span")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--drafting-ids",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[16384, 32768, 49152],
        help="larger drafting vocabularies to compare, the head's ids first (comma-separated)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    target = sd.load_model("smollm2", dtype="float32", quantization=None)
    chats = sorted_answers(args.answers, args.out)
    held, _, _ = read_samples(target, TrainSettings(data=str(chats), held_out=args.held_out, limit=1))
    unseen = []
    params = sd.SamplingParams(max_new_tokens=args.new_tokens)
    for line in UNSEEN.read_text().splitlines():
        prompt = target.chat_prompt(json.loads(line)["turns"][0])
        unseen.append(list(prompt) + list(sd.autoregressive_generate(target, prompt, params).token_ids))
    head, draft_vocab, _ = load_head(shipped_head(target) if args.head == "shipped" else Path(args.head), target)
    others = torch.ones(target.vocab_size, dtype=torch.bool)
    others[draft_vocab] = False  # the head's ids first, then the rest by id: a read-out any size up to the whole
    parts = TargetParts(target.model, target.vocab_size, torch.cat([draft_vocab, others.nonzero().squeeze(1)]))
    sizes = sorted({draft_vocab.numel(), *(n for n in args.drafting_ids if n > draft_vocab.numel())})
    rows = lm_head_rows(target.model)[: target.vocab_size]
    markers = answer_markers(target.tokenizer)
    result = {"head": args.head, "threads": args.threads}
    with torch.no_grad():
        for name, sequences in (("held-out chats", held), ("unseen chat", unseen)):
            cache = FeatureCache(args.out / "features" / name.replace(" ", "_"), target, torch.bfloat16)
            result[name] = report(
                head, parts, rows, cache, sequences, markers, args.new_tokens, sizes, target.tokenizer.decode
            )
            cache.flush()
            print(name, json.dumps(result[name]), flush=True)
    (args.out / "answer_rows.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
