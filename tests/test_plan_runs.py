"""Every command `pipeinfer plan --machines` prints runs the plan it priced: `launch --dry-run` of the same line, on the
same hostfile, gives each rank the layers of plan's table and each host the RAM plan said it needs.

The model is a sparse GGUF of a size plan names (NAMED_TARGETS): its header gives the real layer count, widths, KV
heads and tensor bytes (a layer as one int8 tensor of the layer's bytes), its data is a hole, so the 42.5 GB file
takes no disk. plan reads it with -m as it reads any GGUF, and the dry run reads the same header.
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from pipeinfer.cli.main import main as cli
from pipeinfer.core.topology import layer_ranges, parse_split
from pipeinfer.twin.machines import NAMED_TARGETS, Target, target_from_gguf
from pipeinfer.twin.plan import split_option

HOME = """\
desktop  # pipeinfer: cores=16 mem=64 mem_bw=60 disk=500 link=1000
laptop   # pipeinfer: cores=8 mem=32 mem_bw=40 disk=200 link=1000
minipc   # pipeinfer: cores=4 mem=16 mem_bw=20 disk=100 link=1000
"""
EQUAL = "".join(f"node{i}  # pipeinfer: cores=16 mem=64 mem_bw=60 disk=500 link=10000\n" for i in range(4))
BIG = "big slots=2  # pipeinfer: cores=64 mem=256 mem_bw=200 disk=2000 link=10000\n"


def sparse_gguf(path: Path, t: Target, n_head: int = 64) -> Path:
    """A GGUF whose header is `t`'s (llama architecture) and whose tensor data is a hole of the right length."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(t.n_layer)
    w.add_embedding_length(t.n_embd)
    w.add_head_count(n_head)
    head_dim = t.n_embd // n_head
    w.add_head_count_kv(round(t.kv_bytes_per_pos_layer / (4 * head_dim)))
    w.add_string("tokenizer.ggml.pre", t.pre)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(t.n_vocab)])
    i8 = np.dtype(np.int8)
    rows = int(t.embd_bytes) // t.n_embd  # 2-D, as every GGUF's embedding (its second dimension is read as the vocabulary)
    w.add_tensor_info("token_embd.weight", [rows, t.n_embd], i8, rows * t.n_embd, gguf.GGMLQuantizationType.I8)
    for il in range(t.n_layer):
        w.add_tensor_info(f"blk.{il}.ffn_down.weight", [int(t.layer_bytes)], i8, int(t.layer_bytes),
                          gguf.GGMLQuantizationType.I8)
    w.add_tensor_info("output.weight", [int(t.out_bytes)], i8, int(t.out_bytes), gguf.GGMLQuantizationType.I8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    data_start = -(-path.stat().st_size // 32) * 32
    ends = sum(-(-n // 32) * 32 for n in [rows * t.n_embd, *[int(t.layer_bytes)] * t.n_layer, int(t.out_bytes)])
    os.truncate(path, data_start + ends)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("sparse")
    target = sparse_gguf(d / "llama-3.3-70b-q4_k_m.gguf", NAMED_TARGETS["llama-3.3-70b-q4_k_m"])
    draft = d / "draft.gguf"
    with open(draft, "wb") as f:      # the draft's size is what plan and the dry run read of it
        f.truncate(int(0.81e9))
    return target, draft


def test_the_sparse_model_is_the_named_one(models):
    t, named = target_from_gguf(models[0]), NAMED_TARGETS["llama-3.3-70b-q4_k_m"]
    assert t.n_layer == named.n_layer and t.kv_bytes_per_pos_layer == named.kv_bytes_per_pos_layer
    assert t.layer_bytes == pytest.approx(named.layer_bytes, abs=1) and t.out_bytes == pytest.approx(named.out_bytes, abs=1)


@pytest.mark.parametrize("counts", [[40, 26, 14], [72, 4, 4], [1, 78, 1], [20, 20, 20, 20], [80], [27, 27, 26]])
def test_split_option_gives_back_the_layer_counts(counts):
    text = split_option(counts).split()[1]
    assert [r.n_layers for r in layer_ranges(sum(counts), parse_split(text, len(counts)))] == counts


def _commands(output: str) -> list[str]:
    """Every command plan printed: launch lines (the table's and the recommended one), and a host alone's."""
    out = []
    for line in output.splitlines():
        m = re.search(r"(pipeinfer (?:launch|generate|serve) .*)$", line)
        if m:
            out.append(m.group(1))
    return out


def _plan_ram(output: str) -> dict[str, float]:
    """The RAM per host of the table plan printed for its recommended command."""
    table = output.split("command's hosts:")[1]
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+)\s+([\d.]+) / \S+\s+[\d.]+ / ", table, re.M)}


def _plan_layers(output: str) -> dict[str, str]:
    table = output.split("command's hosts:")[1]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\d+\s+(\S+)\s+\d+\s+(\d+-\d+)", table, re.M)}


def _dry_run(tmp_path, command: str, hosts_text: str):
    """`launch --dry-run` of a printed command; a host alone's `generate`/`serve` through a hostfile of its line."""
    args = shlex.split(command)[1:]
    if args[0] != "launch":
        one = tmp_path / "one-host"
        one.write_text(hosts_text)
        args = ["launch", "--hostfile", str(one), "--", *args]
    i = args.index("--")
    return CliRunner().invoke(cli, [*args[:i], "--dry-run", *args[i:]])


@pytest.mark.parametrize("name,hosts,extra", [
    ("home", HOME, []),
    ("equal", EQUAL, []),
    ("big", BIG, []),
    ("big-alone", BIG.replace("slots=2", "slots=1"), []),
    ("home-clients", HOME, ["--clients", "4", "--n-prompt", "500", "-n", "64"]),
])
def test_every_printed_command_passes_the_dry_run_with_plans_ranges_and_memory(tmp_path, models, name, hosts, extra):
    target, draft = models
    hostfile = tmp_path / "hosts"
    hostfile.write_text(hosts)
    r = CliRunner().invoke(cli, ["plan", "--machines", str(hostfile), "-m", str(target), "--draft", str(draft),
                                 "-n", "16", *extra])
    assert r.exit_code == 0, r.output
    assert "verdict:" in r.output
    commands = _commands(r.output)
    assert commands, r.output
    lines = {h.split()[0]: h for h in hosts.splitlines()}
    for command in commands:
        assert "MODEL.gguf" not in command
        alone = re.search(r"(\S+) alone: .* on \1: pipeinfer", next(
            (ln for ln in r.output.splitlines() if command in ln), ""))
        one = re.sub(r"slots=\d+", "", lines[alone.group(1)]) + "\n" if alone else None  # one process
        dry = _dry_run(tmp_path, command, one or hosts)
        assert dry.exit_code == 0, (command, dry.output)
        ranks = re.findall(r"# rank \d+ (\S+): layers (\d+)-(\d+)(?: \(slice \d+ of \d+ of a tensor group\))?, "
                           r"(\d+) threads", dry.output)
        assert ranks, dry.output
        if "--layer-split" in command:  # one count a stage: a tensor group's ranks share theirs
            counts = [int(c) for c in command.split("--layer-split ")[1].split()[0].split(",")]
            stages = [(a, b) for k, (_, a, b, _t) in enumerate(ranks) if k == 0 or ranks[k - 1][1:3] != (a, b)]
            assert [int(b) - int(a) for a, b in stages] == counts
        threads = command.split(" -t ")[1].split()[0].split(",")
        assert [t for *_, t in ranks] == (threads if len(threads) > 1 else threads * len(ranks))
        if alone:
            assert ranks[0][1:3] == ("0", "80")
    # the recommended command (the last launch line before the groups') and plan's table agree on layers and RAM
    # host by host; the groups' command and their table on RAM
    pipeline_part, _, groups_part = r.output.partition("tensor-parallel groups")
    if "command's hosts:" in pipeline_part:
        recommended = [c for c in _commands(pipeline_part) if c.startswith("pipeinfer launch")][-1]
        dry = _dry_run(tmp_path, recommended, hosts)
        got_ram = {m.group(1): float(m.group(2)) for m in re.finditer(r"# host (\S+): ([\d.]+) GiB", dry.output)}
        got_layers = {m.group(1): f"{m.group(2)}-{m.group(3)}"
                      for m in re.finditer(r"# rank \d+ (\S+): layers (\d+)-(\d+)", dry.output)}
        assert got_ram == pytest.approx(_plan_ram(pipeline_part), abs=0.051)
        assert got_layers == _plan_layers(pipeline_part)
    with_groups = [c for c in _commands(groups_part) if c.startswith("pipeinfer launch")]
    if with_groups:
        dry = _dry_run(tmp_path, with_groups[-1], hosts)
        got_ram = {m.group(1): float(m.group(2)) for m in re.finditer(r"# host (\S+): ([\d.]+) GiB", dry.output)}
        ram_line = next(ln for ln in groups_part.splitlines() if "RAM need/has" in ln)
        planned = {m.group(1): float(m.group(2)) for m in re.finditer(r"(\S+) ([\d.]+)/", ram_line.split(":", 1)[1])}
        assert got_ram == pytest.approx(planned, abs=0.051), (with_groups[-1], dry.output, ram_line)


def test_the_dry_run_refuses_a_rank_that_does_not_fit(tmp_path, models):
    target, _ = models
    hostfile = tmp_path / "hosts"
    hostfile.write_text(HOME)
    r = CliRunner().invoke(cli, ["launch", "--hostfile", str(hostfile), "--dry-run", "--", "generate", "--mode",
                                 "iterative", "-m", str(target), "--layer-split", "10,10,60"])
    assert r.exit_code == 1 and "minipc would need" in r.output and "mem=16" in r.output
    assert "Traceback" not in r.output
    assert len([ln for ln in r.output.splitlines() if ln.startswith("Error")]) == 1


def test_the_dry_run_shows_default_threads_of_described_cores(tmp_path, models):
    target, _ = models
    hostfile = tmp_path / "hosts"
    hostfile.write_text("desktop:3 # pipeinfer: cores=16 mem=64\n")
    r = CliRunner().invoke(cli, ["launch", "--hostfile", str(hostfile), "--dry-run", "--", "generate", "--mode",
                                 "iterative", "-m", str(target)])
    assert r.exit_code == 0, r.output
    assert re.findall(r"(\d+) threads", r.output) == ["6", "5", "5"]  # core/cpus.share(16, 3, i)
    assert "# host desktop:" in r.output
