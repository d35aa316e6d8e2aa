"""``specdecode cache``: list the on-disk cache (sizes, last use, stale or damaged entries); ``cache clean`` empties
it, or only the entries unused for some days, or those no longer usable here."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from specdecode.commands import err

cache_app = typer.Typer(
    help="The on-disk cache (compiled kernels, GGUF metadata and dense copies, synthetic models): `specdecode cache` "
    "lists it; `specdecode cache clean` removes entries. Its folder: $SPECDECODE_CACHE, else "
    "$XDG_CACHE_HOME/specdecode, else ~/.cache/specdecode.",
    no_args_is_help=False,
    invoke_without_command=True,
)
DAY = 86_400.0


def stale_reason(entry, current: dict[str, dict[str, str]]) -> str | None:
    """Why an entry is of no use here (None: it may be used): damaged or half-written, a kernel build for another
    torch, compiler or kernel source, a copy of a GGUF file that is gone or has changed. ``current``: what each
    kernel variant's build is for now (``kernels.built_for``)."""
    if entry.problem is not None:
        return f"damaged: {entry.problem}"
    meta = entry.meta
    if entry.kind == "kernels":
        variant, _, key = entry.folder.name.rpartition("-")
        now = current.get(variant)
        if now is None:
            return "stale: a kernel variant this version does not build"
        if meta.get("torch") not in (None, now["torch"]):
            return f"stale: built for torch {meta['torch']} (this is {now['torch']})"
        if meta.get("compiler") not in (None, now["compiler"]):
            return f"stale: built by {meta['compiler']} (this is {now['compiler']})"
        if key != now["key"]:
            return "stale: other kernel sources, compiler or CPU"
        return None
    source = meta.get("source")
    if source is None:  # an older specdecode's entry without a manifest: checked when next used
        return None
    path = Path(source)
    if not path.is_file():
        return f"stale: {source} is gone"
    stat = path.stat()
    if (stat.st_size, int(stat.st_mtime)) != (meta.get("source_size"), meta.get("source_mtime")):
        return f"stale: {path.name} has changed since"
    return None


def _current_builds() -> dict[str, dict[str, str]]:
    from specdecode import kernels

    try:
        return {variant: kernels.built_for(variant) for variant in kernels.VARIANTS}
    except (OSError, ValueError):  # no compiler here: no kernel build is of use
        return {}


def _age(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    if seconds < DAY:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / DAY:.0f} days ago"


def _size(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB"


@cache_app.callback()
def cache(context: typer.Context) -> None:
    """List the cache's entries: kind, size, last use and whether each is usable here (stale: built for another
    torch or compiler, or from a GGUF file that is gone or has changed; damaged: cut short or half-written)."""
    if context.invoked_subcommand is not None:
        return
    from rich.console import Console
    from rich.table import Table

    from specdecode.disk_cache import cache_root, entries

    root = cache_root()
    found = entries(root)
    if not found:
        err.print(f"the cache at {root} is empty")
        return
    current = _current_builds()
    table = Table(title=str(root), title_justify="left", highlight=False)
    for column in ("kind", "entry", "size", "last used", "state"):
        table.add_column(column, justify="right" if column == "size" else "left")
    now = time.time()
    for entry in found:
        reason = stale_reason(entry, current)
        state = "ok" if reason is None else f"[yellow]{reason}[/yellow]"
        if reason is None and entry.meta.get("unchecked"):
            state = "ok (no manifest yet: checked when next used)"
        table.add_row(entry.kind, entry.folder.name, _size(entry.size), _age(now - entry.last_used), state)
    out = Console(width=max(120, Console().width))
    out.print(table)
    stale = sum(entry.size for entry in found if stale_reason(entry, current) is not None)
    out.print(
        f"{len(found)} entries, {_size(sum(e.size for e in found))}; {_size(stale)} stale or damaged "
        "(`specdecode cache clean --stale` removes those)",
        highlight=False,
    )


OlderThanOption = Annotated[
    float | None, typer.Option(min=0, help="Remove the entries last used more than this many days ago.")
]
StaleOption = Annotated[
    bool,
    typer.Option(
        "--stale", help="Remove the entries of no use here: stale (another torch, compiler, source) or damaged."
    ),
]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Say what would be removed; remove nothing.")]


@cache_app.command("clean")
def clean(
    older_than: OlderThanOption = None,
    stale: StaleOption = False,
    dry_run: DryRunOption = False,
) -> None:
    """Remove cache entries: all of them, or (with --older-than and/or --stale) those that match either option.
    Each is rebuilt when next needed; a process using one keeps reading its files."""
    from specdecode.disk_cache import cache_root, entries, remove

    now = time.time()
    current = _current_builds() if stale else {}
    chosen = []
    for entry in entries(cache_root()):
        old = older_than is not None and now - entry.last_used > older_than * DAY
        useless = stale and stale_reason(entry, current) is not None
        if (older_than is None and not stale) or old or useless:
            chosen.append(entry)
    for entry in chosen:
        if not dry_run:
            remove(entry)
    freed = _size(sum(entry.size for entry in chosen))
    verb = "would remove" if dry_run else "removed"
    err.print(f"{verb} {len(chosen)} cache entries ({freed}) from {cache_root()}", highlight=False)
