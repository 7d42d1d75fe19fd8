"""The command lines quoted in README.md and docs/ still parse against the click definitions.

Every `pipeinfer ...` line in a bash/sh/console code block (after an `mpiexec`/`mpirun` prefix, after `&&`, `;` or
`|`, continuation lines joined) is parsed with the real command group, options and types, without running it:
a renamed or removed option, a wrong choice or a subcommand that no longer exists fails here. Paths that must exist
(a hostfile, a CSV to plot) are placeholders in the docs and are not checked.

The path a new user reads from README.md to a served cluster (USER_PATH) stays under 5,000 words, each of its pages
links to the next, and every term of GLOSSARY_TERMS it uses has an entry in docs/glossary.md.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import click
import pytest

from pipeinfer.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_SHELL = {"bash", "sh", "console", "shell", ""}
_SEPARATORS = {"&&", ";", "|", "||", "&"}
_LAUNCHERS = {"pipeinfer", "mpiexec", "mpirun", "python", "python3", "env", "nohup", "time", "sudo"}


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of every shell code block: continuations joined, prompts and comments dropped."""
    lines, in_block, shell, pending, start = [], False, False, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(raw.strip())
        if fence:
            in_block, shell = (not in_block), fence.group(1) in _SHELL
            continue
        if not (in_block and shell):
            continue
        line = raw.strip()
        if not pending:
            start = number
            line = line.removeprefix("$ ")
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    return lines


def pipeinfer_commands(line: str) -> list[list[str]]:
    """The argument lists given to `pipeinfer` (or `python -m pipeinfer`) on one shell line."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    commands, current = [], []
    for word in words + [";"]:
        if word in _SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(word)
    found = []
    for words in commands:
        if not words or not (words[0] in _LAUNCHERS or "=" in words[0] or words[0].endswith("netns-exec")):
            continue
        if "pipeinfer" not in words:
            continue
        args = words[words.index("pipeinfer") + 1:]
        if args[:1] == ["launch"] and "--" in args:
            found.append(args[:args.index("--")])  # launch's own options, then the command it launches
            found.append(args[args.index("--") + 1:])
        else:
            found.append(args)
    return [args for args in found if args]


def parse(args: list[str]) -> None:
    """Parse args with the real command tree (options, choices and types), invoking nothing."""
    ctx = main.make_context("pipeinfer", list(args), resilient_parsing=False)
    command: click.Command = main
    rest = _unparsed(ctx)
    while isinstance(command, click.Group) and rest:
        name, command, rest = command.resolve_command(ctx, rest)
        if command is None:
            raise click.UsageError(f"no such command: {name}")
        if "--help" in rest or "-h" in rest:
            return
        ctx = command.make_context(name, list(rest), parent=ctx)
        rest = _unparsed(ctx) if isinstance(command, click.Group) else []


def _unparsed(ctx: click.Context) -> list[str]:
    """A group's subcommand and its arguments (click 8.2 deprecates protected_args; click 9 keeps them in args)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return [*getattr(ctx, "protected_args", []), *ctx.args]


def quoted_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOC_FILES:
        for number, line in code_lines(path.read_text()):
            for args in pipeinfer_commands(line):
                found.append((f"{path.relative_to(ROOT)}:{number}", args))
    return found


QUOTED = quoted_commands()

#: Options of a command that the docs already quote with their agreed names while another change builds them: a line
#: using one is skipped while the command lacks it, and parsed like any other once it exists.
PENDING_OPTIONS = {"plan": ("--machines", "--model-size", "-m")}


def pending_options(args: list[str]) -> list[str]:
    """The PENDING_OPTIONS that `args` uses and its command does not define yet."""
    wanted = PENDING_OPTIONS.get(args[0], ()) if args else ()
    command = main.commands.get(args[0]) if wanted else None
    if command is None:
        return []
    known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    used = {a.split("=", 1)[0] for a in args[1:]}
    return [opt for opt in wanted if opt in used and opt not in known]


def test_the_docs_quote_commands():
    assert len(QUOTED) >= 20, "the README and docs quote fewer command lines than expected: is the extraction broken?"


@pytest.mark.parametrize("where,args", QUOTED, ids=[f"{w} {' '.join(a)[:40]}" for w, a in QUOTED])
def test_quoted_command_parses(where, args):
    if missing := pending_options(args):
        pytest.skip(f"{where}: pipeinfer {args[0]} does not have {', '.join(missing)} yet (PENDING_OPTIONS)")
    try:
        parse(args)
    except click.BadParameter as e:
        if "does not exist" in e.format_message():
            return  # a placeholder path (HOSTS, results.csv) in the docs
        pytest.fail(f"{where}: pipeinfer {' '.join(args)}: {e.format_message()}")
    except click.ClickException as e:
        pytest.fail(f"{where}: pipeinfer {' '.join(args)}: {e.format_message()}")


def test_a_wrong_option_is_caught():
    with pytest.raises(click.UsageError):
        parse(["generate", "--no-such-option"])
    with pytest.raises(click.UsageError):
        parse(["no-such-command"])
    with pytest.raises(click.BadParameter):
        parse(["generate", "--mode", "fastest"])
    parse(["generate", "-n", "8", "--mode", "iterative"])


def test_extraction_of_shell_lines():
    text = "x\n```bash\nmpiexec -n 2 pipeinfer generate \\\n  -n 8  # a comment\n$ pipeinfer models list && ls\n```\n" \
           "```python\npipeinfer serve --nope\n```\n"
    got = [args for _, line in code_lines(text) for args in pipeinfer_commands(line)]
    assert got == [["generate", "-n", "8"], ["models", "list"]]
    launch = pipeinfer_commands("pipeinfer launch --hostfile H -- serve --port 8080")
    assert launch == [["launch", "--hostfile", "H"], ["serve", "--port", "8080"]]


def test_the_command_reference_is_the_codes():
    """docs/cli.md is what launch/docgen/cli_reference.py writes from the click definitions today."""
    p = subprocess.run([sys.executable, str(ROOT / "launch" / "docgen" / "cli_reference.py"), "--check"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr


def test_the_architectures_table_is_the_split_rules():
    """docs/architectures.md's table of every architecture is what launch/docgen/architectures_table.py writes from
    stagefile.SPLIT_RULES and NOT_SPLITTABLE today (re-run it after changing a rule), and names every architecture
    of the vendored llama.cpp when its source is here (launch/bench/bench_peers.py fetches it)."""
    from importlib import metadata
    p = subprocess.run([sys.executable, str(ROOT / "launch" / "docgen" / "architectures_table.py"), "--check"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr
    home = Path(os.environ.get("PIPEINFER_CACHE", Path.home() / ".cache" / "pipeinfer")) / "peers"
    src = home / f"llama_cpp_python-{metadata.version('llama_cpp_python')}" / "vendor" / "llama.cpp"
    if not (src / "src" / "llama-arch.cpp").exists():
        pytest.skip(f"no vendored llama.cpp source at {src}")
    sys.path.insert(0, str(ROOT / "launch" / "docgen"))
    try:
        import architectures_table
    finally:
        sys.path.remove(str(ROOT / "launch" / "docgen"))
    assert set(architectures_table.vendored_names(src / "src")) == set(architectures_table.LARGEST)


def test_pending_options_are_parsed_once_they_exist():
    has = {opt for param in main.commands["plan"].params for opt in param.opts}
    expected = [] if "--machines" in has else ["--machines"]
    assert pending_options(["plan", "--machines", "hosts"]) == expected
    assert pending_options(["plan", "--machines=hosts"]) == expected
    assert pending_options(["plan", "--profile", "p.json"]) == []
    assert pending_options(["generate", "--machines", "hosts"]) == []   # only the listed commands wait


# ------------------------------------------------------------------------------------ the path a new user reads
#: From README.md to a served cluster, in reading order: the first cluster page carries the serving basics (a key,
#: the page, a client), so serving.md stays a reference outside the path.
USER_PATH = ["README.md", "docs/install.md", "docs/first-cluster.md", "docs/glossary.md"]
USER_PATH_WORDS = 5000

#: Terms every page of the path may use only with a glossary entry; the first ones must be defined in any case.
GLOSSARY_REQUIRED = ("rank", "stage", "slot", "hub", "re-form", "micro-batch", "exact batch limit", "kernel key",
                     "agreement", "acceptance", "draft", "target", "head", "hostfile", "split")
GLOSSARY_TERMS = GLOSSARY_REQUIRED + ("stage file", "drafter", "run", "partition", "stall timeout", "supervised",
                                      "cutoff", "twin", "weights cache", "job step", "allocation", "hydra",
                                      "liveness hub", "layer split")


def glossary_entries() -> set[str]:
    """The terms docs/glossary.md defines: each entry's bold head, split at commas and parentheses, lower case."""
    text = (ROOT / "docs" / "glossary.md").read_text()
    heads = re.findall(r"^- \*\*(.+?)\*\*:", text, re.M)
    return {part.strip().lower() for head in heads for part in re.split(r"[,()]", head) if part.strip()}


def test_the_path_to_a_served_cluster_is_under_5000_words():
    words = {page: len((ROOT / page).read_text().split()) for page in USER_PATH}
    assert sum(words.values()) <= USER_PATH_WORDS, \
        f"the path from README.md to a served cluster is {sum(words.values())} words, over {USER_PATH_WORDS}: {words}"


def test_each_page_of_the_path_links_to_the_next():
    for page, after in zip(USER_PATH, USER_PATH[1:]):
        link = os.path.relpath(ROOT / after, (ROOT / page).parent)
        assert f"]({link}" in (ROOT / page).read_text(), f"{page} does not link to {after} ({link})"


def test_the_glossary_defines_the_words_of_the_path():
    defined = glossary_entries()
    assert not [t for t in GLOSSARY_REQUIRED if t not in defined], "terms without a glossary entry"
    used = "\n".join((ROOT / page).read_text() for page in USER_PATH if not page.endswith("glossary.md"))
    missing = [term for term in GLOSSARY_TERMS
               if re.search(rf"(?<![\w-]){re.escape(term)}(s|es)?(?!\w)", used, re.I) and term not in defined]
    assert not missing, f"the path uses {missing} but docs/glossary.md has no entry for them"


def test_a_missing_glossary_entry_is_caught():
    assert {"rank", "stage", "stage file", "hub", "liveness hub", "split", "layer split"} <= glossary_entries()
    assert "no such term" not in glossary_entries()


# ------------------------------------------------------------------------------------ the words `plan` prints
#: Words `pipeinfer plan` prints that a reader looks up: each one it prints has a glossary entry.
PLAN_TERMS = ("interleaving", "one row", "serial share", "closed-loop", "profiled draft", "exact batch limit")
PLAN_HOSTS = """\
xeon-a    # pipeinfer: cores=16 mem=64 mem_bw=60 disk=500 link=1000
xeon-b    # pipeinfer: cores=16 mem=64 mem_bw=60 disk=500 link=1000
laptop    # pipeinfer: role=draft cores=4 mem=8 mem_bw=20 disk=50 link=1000
"""


def test_the_glossary_defines_the_words_plan_prints(tmp_path):
    from click.testing import CliRunner
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(PLAN_HOSTS)
    r = CliRunner().invoke(main, ["plan", "--machines", str(hosts), "--model-size", "70b-q4_k_m", "-n", "8",
                                  "--clients", "2"])
    assert r.exit_code == 0, r.output
    printed = [t for t in PLAN_TERMS if re.search(rf"(?<![\w-]){re.escape(t)}(?!\w)", r.output, re.I)]
    assert printed == list(PLAN_TERMS), f"this run no longer prints {set(PLAN_TERMS) - set(printed)}: run one that does"
    missing = [t for t in printed if t not in glossary_entries()]
    assert not missing, f"plan prints {missing} but docs/glossary.md has no entry for them"
