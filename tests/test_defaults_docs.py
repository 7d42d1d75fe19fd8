"""Defaults said in words are the code's: --parallel's default (decide/batching.py: PARALLEL_PER_STAGE and
PARALLEL_PER_STAGE_BATCHED) as `serve --help`, `generate --help`, `plan --help` and docs/serving.md say it.
(docs/cli.md is the help texts, written by launch/docgen/cli_reference.py and checked by tests/test_docs.py.)"""
from __future__ import annotations

import re
from pathlib import Path

import click

from pipeinfer.cli.main import main
from pipeinfer.decide.batching import PARALLEL_PER_STAGE_BATCHED, default_parallel, default_parallel_text

ROOT = Path(__file__).resolve().parent.parent


def option_help(command: str, option: str) -> str:
    (param,) = [p for p in main.commands[command].params if option in p.opts]
    assert isinstance(param, click.Option)
    return param.help


def test_the_words_are_the_rule():
    """default_parallel_text's numbers are default_parallel's per stage, batched (--batch-rows auto, the
    default) and not (--batch-rows 1)."""
    batched, unbatched = map(int, re.fullmatch(r"(\d+) per pipeline stage \((\d+) with --batch-rows 1\)",
                                               default_parallel_text()).groups())
    assert [default_parallel(n, batching=True) for n in (1, 2, 3)] == [batched, 2 * batched, 3 * batched]
    assert [default_parallel(n, batching=False) for n in (1, 2, 3)] == [unbatched, 2 * unbatched, 3 * unbatched]


def test_serve_and_generate_help_say_the_default():
    assert f"[default: {default_parallel_text()};" in option_help("serve", "--parallel")
    assert f"[default: {default_parallel_text()}]" in option_help("generate", "--parallel")


def test_plan_help_says_serves_default():
    """plan --clients runs serve's default schedule, which batches: the batched number per stage."""
    assert f"[default: {PARALLEL_PER_STAGE_BATCHED} per stage, as serve]" in option_help("plan", "--parallel")


def test_the_serving_page_says_the_default():
    rows = [line for line in (ROOT / "docs" / "serving.md").read_text().splitlines()
            if line.startswith("| `--parallel N` |")]
    assert len(rows) == 1, rows
    default = rows[0].split("|")[2].strip().replace("`", "")
    assert default == default_parallel_text(), rows[0]


def test_no_page_or_help_says_another_per_stage_default():
    """Any "[default: N per ... stage" in the docs (the command reference included) names the code's N."""
    said = {int(n) for page in (ROOT / "docs").glob("*.md")
            for n in re.findall(r"default: (\d+) per (?:pipeline )?stage", page.read_text())}
    assert said <= {PARALLEL_PER_STAGE_BATCHED}, said
