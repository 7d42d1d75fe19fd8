"""docs/cli.md, the command reference, written from the click definitions (pipeinfer/cli) by mkdocs-click's
renderer into plain Markdown: the same page on the docs site and on GitHub, and tests/test_docs.py fails when it
is out of date.

    python launch/docgen/cli_reference.py            # write docs/cli.md
    python launch/docgen/cli_reference.py --check    # exit 1 if docs/cli.md is not what the code gives
"""
from __future__ import annotations

import sys
from pathlib import Path

from mkdocs_click._docs import make_command_docs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, on_path  # noqa: E402

on_path()
from pipeinfer.cli.main import main  # noqa: E402

PAGE = ROOT / "docs" / "cli.md"
HEAD = """# Command line

Written from the click definitions (`pipeinfer/cli`) by `python launch/docgen/cli_reference.py`; tests/test_docs.py fails
when it differs from the code.

"""


def reference() -> str:
    """The page: each command's heading its whole command line (the anchors #pipeinfer-launch, ... the other pages
    link to), no default shown where click has none (its `Sentinel.UNSET`)."""
    out, path = [], []
    for line in make_command_docs(prog_name="pipeinfer", command=main, depth=1, style="table",
                                  list_subcommands=True):
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            path = path[:level - 2] + [line.lstrip("#").strip()]
            line = "#" * level + " " + " ".join(["pipeinfer", *path[1:]] if len(path) > 1 else path)
        out.append(line.replace("`Sentinel.UNSET`", ""))
    return HEAD + "\n".join(out).strip() + "\n"


if __name__ == "__main__":
    text = reference()
    if "--check" in sys.argv[1:]:
        if PAGE.read_text() != text:
            sys.exit("docs/cli.md is out of date: python launch/docgen/cli_reference.py")
    else:
        PAGE.write_text(text)
