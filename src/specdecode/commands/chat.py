"""`specdecode chat`: an interactive chat in the terminal, one line a turn, on one long-lived decoder.

Each turn's prompt is the whole conversation in the model's chat template; the decoder keeps its KV cache
between turns and prefills only what the new prompt adds (``SpeculativeDecoder``'s prefix reuse), so the wait
for a turn's first token does not grow with the history. Reads standard input line by line (pipe a file to
script it); ``/reset`` starts over, ``/exit`` (or end of input) leaves.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from specdecode import factory
from specdecode.commands import err, quiet_transformers
from specdecode.commands.generate import default_proposer, stats_line
from specdecode.commands.options import (
    DraftOption,
    DtypeOption,
    GammaOption,
    GroupSizeOption,
    HeadOption,
    HeadsOption,
    MaxContextOption,
    MaxNewTokensOption,
    ModeOption,
    ProposerChoice,
    ProposerOption,
    QuantizationOption,
    SeedOption,
    ShowOption,
    TargetOption,
    TemperatureOption,
    TopKOption,
    TopPOption,
    TreeNodesOption,
    parse_gamma,
)

if TYPE_CHECKING:
    from specdecode import GenerationOutput, LoadedModel

SystemOption = Annotated[str | None, typer.Option(help="A system message that opens the conversation.")]


def chat(
    target: TargetOption = "smollm2",
    draft: DraftOption = None,
    proposer: ProposerOption = None,
    gamma: GammaOption = "auto",
    mode: ModeOption = "exact",
    temperature: TemperatureOption = 0.0,
    top_k: TopKOption = 0,
    top_p: TopPOption = 1.0,
    seed: SeedOption = None,
    max_new_tokens: MaxNewTokensOption = 256,
    system: SystemOption = None,
    show: ShowOption = False,
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = "auto",
    group_size: GroupSizeOption = 32,
    max_context: MaxContextOption = None,
    head: HeadOption = None,
    tree_nodes: TreeNodesOption = None,
    heads: HeadsOption = None,
) -> None:
    """Chat with TARGET in the terminal: one line a turn, answers streamed, a stats line after each."""
    from specdecode import SamplingParams, SpeculativeDecoder

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    factory.parse_quantization(quantization)
    choice = proposer or default_proposer(draft, head, heads)
    if choice is ProposerChoice.draft and not draft:
        raise ValueError("--proposer draft needs --draft PATH, self:N or skip:SKIP.json")
    quiet_transformers()
    with err.status(f"loading {target}…"):
        model = factory.load(target, dtype, quantization, group_size, max_context)
        chosen = None
        if choice is not ProposerChoice.none:
            chosen = factory.build_proposer(
                choice.value, model, draft, dtype, quantization, group_size, head=head, tree_nodes=tree_nodes,
                heads=heads,
            )  # fmt: skip
    # gamma 1 with no proposer: plain decoding through the same decoder (and its cache reuse)
    decoder = SpeculativeDecoder(model, chosen, gamma=parse_gamma(gamma), mode=mode)
    if chosen is None:
        decoder.use_proposer(_Nothing())
    conversation = Conversation(model, system)
    for line in _turns():
        if line == "/reset":
            conversation = Conversation(model, system)
            continue
        on_text = None if show else _write
        out = decoder.generate(conversation.prompt(line), params, on_text=on_text)
        if show:
            _print_shown(model, out)
        else:
            print(flush=True)
        conversation.answer(out.text)
        reused = f"; prompt {len(out.prompt_ids)} tokens, {out.cached_tokens} reused from the last turn"
        err.print(f"[dim]{stats_line(out, choice)}{reused}[/dim]", highlight=False)


class Conversation:
    """The messages so far; a turn's prompt is all of them in the chat template (plain text joined by newlines
    when the model has none)."""

    def __init__(self, model: LoadedModel, system: str | None) -> None:
        self.model = model
        self.messages = [] if system is None else [{"role": "system", "content": system}]

    def prompt(self, text: str) -> list[int]:
        self.messages.append({"role": "user", "content": text})
        return self.model.chat_ids(self.messages)

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


class _Nothing:
    """A proposer that never guesses: every round a plain step."""

    def propose(self, context, k, params, generator):
        from specdecode.sampling.draft import EMPTY_DRAFT

        return EMPTY_DRAFT


def _turns():
    """Non-empty lines of standard input until ``/exit`` or its end; a prompt on a terminal."""
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            err.print("[bold]>[/bold] ", end="")
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return
        if line.strip():
            yield line.strip()


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _print_shown(model: LoadedModel, out: GenerationOutput) -> None:
    from rich.console import Console

    from specdecode.commands.show import coloured, legend
    from specdecode.engine.provenance import token_pieces

    console = Console(highlight=False, soft_wrap=True)
    console.print(coloured(token_pieces(model.decode, out.token_ids, out.text), out.sources))
    err.print(legend(out.sources), highlight=False, soft_wrap=True)
