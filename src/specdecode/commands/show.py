"""`generate --show`: the answer coloured by how each token was made, with a legend and a count by source."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rich.text import Text

from specdecode.engine.provenance import TokenSource

GUESS_STYLES = ("black on green3", "black on spring_green2", "black on aquamarine1")  # depth 1, 2, 3 and deeper
TARGET_STYLES = {"recovered": "bold red", "bonus": "bold yellow", "plain": ""}


def style_of(source: TokenSource) -> str:
    """Accepted guesses on a green scale by depth; the target's own tokens by kind (plain ones unstyled)."""
    if source.kind == "accepted":
        return GUESS_STYLES[min(source.depth, len(GUESS_STYLES)) - 1]
    return TARGET_STYLES[source.kind]


def coloured(pieces: Sequence[str], sources: Sequence[TokenSource]) -> Text:
    """The answer, each token's piece in its source's style."""
    text = Text()
    for piece, source in zip(pieces, sources, strict=True):
        text.append(piece, style=style_of(source))
    return text


def legend(sources: Sequence[TokenSource]) -> Text:
    """One line: each style with what it means and how many tokens have it."""
    kinds = Counter(s.kind for s in sources)
    depths = Counter(min(s.depth, len(GUESS_STYLES)) for s in sources if s.kind == "accepted")
    line = Text("guessed and accepted at depth ")
    for depth, style in enumerate(GUESS_STYLES, start=1):
        label = f"{depth}{'+' if depth == len(GUESS_STYLES) else ''}"
        line.append(f" {label} ({depths[depth]}) ", style=style)
        line.append(" ")
    line.append("· the target's own: ")
    line.append(f"recovered after a rejection ({kinds['recovered']})", style=TARGET_STYLES["recovered"])
    line.append(", ")
    line.append(f"bonus ({kinds['bonus']})", style=TARGET_STYLES["bonus"])
    line.append(f", plain step ({kinds['plain']})")
    return line
