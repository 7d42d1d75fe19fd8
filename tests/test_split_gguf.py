"""Split GGUFs (llama.cpp's gguf-split sets, NAME-00001-of-0000N.gguf) everywhere pipeinfer reads a GGUF: the headers,
stage files, layouts that travel, the registry, `models drafts`, `plan -m`, and every mode on 2 and 3 ranks, from sets
written by llama.cpp's own gguf-split (launch/gguf_split.py builds it from the vendored llama.cpp)."""
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import PROMPT, cli, host_envs, mpirun, real_model, run_on_hosts
from gguf_split import ToolUnavailable, gguf_split_binary, split_gguf
from synth import PERTURB_FOR_AGREEMENT, make_llama_gguf, reference_greedy

N = 48


@pytest.fixture(scope="module")
def tool():
    try:
        return gguf_split_binary()
    except ToolUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def split(tool, tmp_path_factory):
    """A q8_0 target and an f32 draft (4 layers, 39 tensors each), each also split by gguf-split in 3 parts."""
    d = tmp_path_factory.mktemp("split")
    one = make_llama_gguf(d / "t.gguf", n_layer=4, qtype="q8_0")
    draft = make_llama_gguf(d / "d.gguf", n_layer=4, perturb=PERTURB_FOR_AGREEMENT[4][0.6])
    parts = split_gguf(one, d / "parts" / "t", max_tensors=15)
    dparts = split_gguf(draft, d / "dparts" / "d", max_tensors=15)
    return SimpleNamespace(one=one, parts=parts, first=parts[0], draft=draft, dparts=dparts)


def _stream(layout, files, chunk: int = 4096) -> bytes:
    """The bytes a layout reads from a model's files (a split GGUF's parts in order)."""
    fds = [os.open(f, os.O_RDONLY) for f in files]
    try:
        buf, out, off = np.empty(chunk, np.uint8), bytearray(), 0
        while off < layout.size:
            n = layout.read(fds, off, buf)
            out += buf[:n].tobytes()
            off += n
        return bytes(out)
    finally:
        for fd in fds:
            os.close(fd)


# ---------------------------------------------------------------- what a set is, by its names and split keys
def test_part_names_and_what_the_split_keys_say(tmp_path):
    from pipeinfer.engine.gguf_parts import PartName, SplitSetError, is_split, part_name, part_paths, set_stem
    assert part_name("/m/Qwen3-235B-Q4_K_M-00002-of-00005.gguf") == PartName("/m/Qwen3-235B-Q4_K_M", 2, 5)
    assert part_name("/m/q-00006-of-00005.gguf") is None and part_name("/m/q.gguf") is None
    assert PartName("/m/q", 1, 3).path(3) == "/m/q-00003-of-00003.gguf"
    assert set_stem("/m/q-00001-of-00003.gguf") == "q" and set_stem("/m/q.gguf") == "q"
    assert not is_split(None, None) and not is_split(0, 1) and is_split(0, 3) and is_split(1, 3)
    assert part_paths(tmp_path / "x.gguf", None, None) == (str(tmp_path / "x.gguf"),)
    with pytest.raises(SplitSetError, match="is part 3 of 4 of a split GGUF: pass its first part, q-00001-of-00004"):
        part_paths(tmp_path / "q-00003-of-00004.gguf", 2, 4)
    for i in (1, 2):
        (tmp_path / f"q-0000{i}-of-00003.gguf").touch()
    with pytest.raises(SplitSetError, match=r"split GGUF q: part 3 of 3, .*q-00003-of-00003\.gguf, is missing"):
        part_paths(tmp_path / "q-00001-of-00003.gguf", 0, 3)
    (tmp_path / "q-00003-of-00003.gguf").touch()
    assert len(part_paths(tmp_path / "q-00001-of-00003.gguf", 0, 3)) == 3


# ---------------------------------------------------------------- reading a set
def test_gguf_split_writes_three_parts_with_their_split_keys(split):
    from pipeinfer.engine.gguf_parts import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS, part_name
    from pipeinfer.engine.ggufheader import read_file_header
    assert [p.name for p in split.parts] == [f"t-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for i, p in enumerate(split.parts):
        f = read_file_header(p).fields
        assert (f[SPLIT_NO], f[SPLIT_COUNT], f[SPLIT_TENSORS]) == (i, 3, 39)
        assert part_name(p).no == i + 1 and part_name(p).path(1) == str(split.first)
    assert "general.architecture" not in read_file_header(split.parts[1]).fields  # the first part holds the metadata
    import gguf  # the constants are gguf-py's
    assert (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS) == (gguf.Keys.Split.LLM_KV_SPLIT_NO, gguf.Keys.Split.LLM_KV_SPLIT_COUNT,
                                                      gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)


def test_a_set_reads_as_the_single_file(split):
    from pipeinfer.engine.gguf_parts import SPLIT_KEYS
    from pipeinfer.engine.ggufheader import model_files, model_size, read_header, tensor_rows
    from pipeinfer.engine.stagefile import layer_costs, range_check, read_info
    one, whole = read_header(split.one), read_header(split.first)
    assert whole.files == tuple(map(str, split.parts)) == model_files(split.first)
    assert model_size(split.first) == sum(p.stat().st_size for p in split.parts)
    assert {k: v for k, v in whole.fields.items() if k not in SPLIT_KEYS} == one.fields
    assert list(whole.tensors) == list(one.tensors)
    assert {t.file for t in whole.tensors.values()} == set(map(str, split.parts))  # tensors from every part
    for name, t in whole.tensors.items():
        u = one.tensors[name]
        assert (t.shape, t.ggml_type) == (u.shape, u.ggml_type)
        with open(t.file, "rb") as a, open(split.one, "rb") as b:
            a.seek(t.offset)
            b.seek(u.offset)
            assert a.read(t.nbytes) == b.read(u.nbytes), name
    emb = whole.tensors["token_embd.weight"]
    assert np.array_equal(tensor_rows(split.first, emb), tensor_rows(split.one, one.tensors["token_embd.weight"]))
    assert read_info(split.first) == read_info(split.one)
    assert layer_costs(split.first) == layer_costs(split.one)
    assert range_check(split.first) == range_check(split.one)


def test_stage_files_of_the_parts_are_the_single_files_stage_files(split):
    from pipeinfer.engine.stagefile import ensure_pruned_head, ensure_stage_file
    for a, b, vocab in [(0, 2, False), (2, 4, True), (1, 3, False), (0, 4, True)]:
        mine, theirs = ensure_stage_file(split.first, a, b, vocab), ensure_stage_file(split.one, a, b, vocab)
        assert mine.read_bytes() == theirs.read_bytes()  # one file, every part's tensors, no split keys
        assert mine.name.startswith(f"t.L{a}-{b}.") and mine != theirs  # named after the set, keyed by its parts
    head, keep = ensure_pruned_head(split.dparts[0], 64)
    assert head.name.startswith("d.head64.")
    assert head.read_bytes() == ensure_pruned_head(split.draft, 64)[0].read_bytes()


def test_layouts_stream_from_the_parts(split):
    from pipeinfer.engine.stagefile import (HeaderReader, ensure_stage_file, recipe, stage_layout, vocab_layout,
                                            whole_layout)
    reader = HeaderReader(split.first)
    for a, b, vocab in [(0, 2, False), (2, 4, True)]:
        layout = stage_layout(split.first, a, b, vocab)
        assert {p.src_part for p in layout.pieces if p.src_offset >= 0} > {0}  # bytes from later parts
        want = ensure_stage_file(split.one, a, b, vocab).read_bytes()
        assert _stream(layout, split.parts) == want
        assert _stream(stage_layout(split.first, a, b, vocab, reader=reader), split.parts) == want
    assert _stream(vocab_layout(split.first), split.parts) == _stream(vocab_layout(split.one), [split.one])
    # a split draft travels whole as one GGUF: here the very bytes gguf-split was given
    assert _stream(whole_layout(split.dparts[0]), split.dparts, 3000) == split.draft.read_bytes()
    held = {"held.gguf": stage_layout(split.first, 0, 2, False)}
    rc = recipe(stage_layout(split.first, 1, 3, False), held)
    assert rc.local and rc.wire_bytes() < rc.size  # layer 1, held, is copied on the host, not sent


def test_the_identity_of_a_set_is_the_hash_of_its_parts_in_order(split, tmp_path):
    from pipeinfer.core import stagecache
    first, *rest = copies = [tmp_path / p.name for p in split.parts]
    for p, q in zip(split.parts, copies):
        q.write_bytes(p.read_bytes())
    ident, _ = stagecache.model_identity(first, tmp_path, parts=tuple(rest))
    assert ident == stagecache.content_hash(b"".join(p.read_bytes() for p in split.parts)).hexdigest()
    assert stagecache.known_identity(first, tmp_path, parts=tuple(rest)) == ident
    os.utime(rest[1], ns=(1, 1))  # a part replaced or touched: hashed again
    assert stagecache.known_identity(first, tmp_path, parts=tuple(rest)) is None


# ---------------------------------------------------------------- a wrong part, a missing part: one line
def test_a_later_part_or_a_missing_one_is_one_line(split, tmp_path):
    from pipeinfer.engine.models import ModelError, resolve_model
    from pipeinfer.engine.stagefile import StageFileError, read_info
    for later in split.parts[1:]:
        with pytest.raises(ModelError, match=r"is part [23] of 3 of a split GGUF: pass its first part, "
                                             r"t-00001-of-00003\.gguf"):
            resolve_model(later)
        with pytest.raises(StageFileError, match="pass its first part"):
            read_info(later)
    for p in split.parts[:2]:
        (tmp_path / p.name).write_bytes(p.read_bytes())
    first = tmp_path / split.first.name
    missing = tmp_path / split.parts[2].name
    with pytest.raises(ModelError, match=f"split GGUF t: part 3 of 3, {missing}, is missing"):
        resolve_model(first)
    with pytest.raises(StageFileError, match="is missing"):
        read_info(first)
    renamed = tmp_path / "renamed.gguf"
    first.rename(renamed)
    with pytest.raises(ModelError, match="does not end in -00001-of-00003.gguf"):
        resolve_model(renamed)
    with pytest.raises(ModelError, match=r"a split GGUF is named by its first part: .*t-00001-of-00003\.gguf"):
        resolve_model(split.first.parent / "t.gguf")
    for args, n in ((["generate", "-m", str(split.parts[1]), "-p", "hi", "-n", "2"], 2),
                    (["generate", "-m", str(renamed), "-p", "hi", "-n", "2"], None),
                    (["models", "drafts", str(split.parts[2])], None)):
        p = cli(args, n=n, timeout=60)
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
        errors = [line for line in p.stderr.splitlines() if line.startswith("pipeinfer: error")]
        assert len(errors) == 1 and ("first part" in errors[0] or "-00001-of-00003" in errors[0]), p.stderr


# ---------------------------------------------------------------- the registry, `models drafts`, `plan -m`
def test_a_set_is_identified_by_its_first_part_and_the_sum_of_its_parts(split, monkeypatch):
    import hashlib

    from pipeinfer.engine import models
    head = hashlib.sha256(split.first.read_bytes()[:models.HEAD_BYTES]).hexdigest()
    size = sum(p.stat().st_size for p in split.parts)
    spec = replace(models.MODELS["gemma3-270m"], name="split-t", size=size, head_sha256=head)
    monkeypatch.setitem(models.MODELS, "split-t", spec)
    assert models.identify(split.first) == "split-t"
    assert models.identify(split.parts[1]) is None
    assert models.identify(split.one) is None


def test_models_drafts_reads_a_set(split):
    from pipeinfer.cli.models_cmd import models_group
    r = CliRunner().invoke(models_group, ["drafts", str(split.first)])
    assert r.exit_code == 0, r.output
    assert r.output == CliRunner().invoke(models_group, ["drafts", str(split.one)]).output


def test_plan_reads_a_set(split, tmp_path):
    from pipeinfer.cli.main import main
    from pipeinfer.twin.machines import target_from_gguf
    mine, theirs = target_from_gguf(split.first), target_from_gguf(split.one)
    assert mine.file_bytes == sum(p.stat().st_size for p in split.parts)
    assert replace(mine, name=theirs.name, file_bytes=theirs.file_bytes) == theirs
    hosts = tmp_path / "hosts"
    hosts.write_text("a # pipeinfer: cores=4 mem=8 mem_bw=20 disk=50 link=1000\n"
                     "b # pipeinfer: cores=4 mem=8 mem_bw=20 disk=50 link=1000\n")
    r = CliRunner().invoke(main, ["plan", "--machines", str(hosts), "-m", str(split.first), "-n", "16"])
    assert r.exit_code == 0, r.output
    assert f"-m {split.first}" in [ln for ln in r.output.splitlines() if "pipeinfer launch" in ln][-1]


# ---------------------------------------------------------------- every mode on 2 and 3 ranks
@pytest.fixture(scope="module")
def ref(split):
    return reference_greedy(split.one, PROMPT, N)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["iterative", "speculative", "pipeinfer"])
@pytest.mark.parametrize("n_ranks", [2, 3])
def test_every_mode_from_the_parts_gives_the_single_files_tokens(split, ref, mode, n_ranks):
    cfg = {"model": str(split.first), "prompt": PROMPT, "n": N, "mode": mode}
    if mode != "iterative":
        cfg["draft"] = str(split.dparts[0])  # the draft split too
    out = mpirun(n_ranks, cfg)
    assert out["tokens"] == ref
    assert mode == "iterative" or out["stats"]["n_drafted"] > 0
    assert len(out["ranges"]) == n_ranks and out["ranges"][-1][1] == 4


# ---------------------------------------------------------------- weights travel from the parts
GEN = ["generate", "-p", "hi", "-n", "8", "-t", "1"]


def _cached(tmp: Path, r: int) -> list[str]:
    d = tmp / f"cache{r}" / "weights"
    return sorted(p.name for p in d.iterdir() if p.suffix == ".gguf") if d.exists() else []


@pytest.mark.mpi
def test_the_first_start_sends_the_hosts_their_stages_from_the_parts(split, tmp_path):
    from pipeinfer.core import stagecache
    args = GEN + ["--mode", "iterative", "-m"]
    reference = run_on_hosts(args + [str(split.one)], [{}, {}, {}])
    assert reference.returncode == 0, reference.stderr[-3000:]
    hosts = host_envs(tmp_path, 3)
    partial = tmp_path / "root1" / split.first.relative_to("/")  # host 1 holds the first part alone
    partial.parent.mkdir(parents=True)
    partial.write_bytes(split.first.read_bytes())
    p = run_on_hosts(args + [str(split.first)], hosts)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == reference.stdout
    assert "weights: sent rank 1" in p.stderr and "weights: sent rank 2" in p.stderr
    ident = stagecache.content_hash(b"".join(x.read_bytes() for x in split.parts)).hexdigest()
    for r in (1, 2):
        (name,) = _cached(tmp_path, r)
        assert name.startswith(ident[:32])
    again = run_on_hosts(args + [str(split.first)], hosts)
    assert again.returncode == 0 and again.stdout == reference.stdout, again.stderr[-3000:]
    assert "weights: sent" not in again.stderr


@pytest.mark.mpi
def test_a_draft_rank_gets_a_split_draft_whole_and_the_split_targets_vocabulary(split, tmp_path):
    args = GEN + ["--mode", "pipeinfer", "--draft-at", "rank", "-m", str(split.first), "--draft", str(split.dparts[0])]
    reference = run_on_hosts(args, [{}, {}, {}])
    assert reference.returncode == 0, reference.stderr[-3000:]
    hosts = host_envs(tmp_path, 3)
    hosts[1] = {"PIPEINFER_CACHE": str(tmp_path / "cache1")}  # the second stage's host has the model
    p = run_on_hosts(args, hosts)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == reference.stdout
    names = _cached(tmp_path, 2)
    (whole,) = [n for n in names if n.endswith(".whole.gguf")]
    assert any(".vocab." in n for n in names), names
    assert (tmp_path / "cache2" / "weights" / whole).read_bytes() == split.draft.read_bytes()


# ---------------------------------------------------------------- the real Qwen split in 3 parts
@pytest.fixture(scope="module")
def qwen_parts(tool, tmp_path_factory):
    qwen = real_model("qwen2.5-coder-1.5b")
    d = tmp_path_factory.mktemp("qsplit")
    parts = split_gguf(qwen, d / "q", max_tensors=120)
    assert len(parts) == 3
    yield SimpleNamespace(one=qwen, parts=parts)
    shutil.rmtree(d, ignore_errors=True)  # 1.1 GB


@pytest.mark.real
@pytest.mark.mpi
def test_real_qwen_from_three_parts_generates_the_single_files_tokens(qwen_parts, tmp_path):
    args = ["generate", "-q", "-p", "def quicksort(items):", "-n", "16", "--temp", "0", "-t", "1", "--mode",
            "iterative", "-m"]
    single = cli(args + [qwen_parts.one], n=2, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    parts = cli(args + [str(qwen_parts.parts[0])], n=2, timeout=300)
    assert parts.returncode == 0, parts.stderr[-3000:]
    assert parts.stdout == single.stdout and single.stdout.strip()
    # a host without the model receives its stage, made from the parts, from rank 0
    loud = [a for a in args if a != "-q"]
    travelled = run_on_hosts(loud + [str(qwen_parts.parts[0])], host_envs(tmp_path, 2), timeout=600)
    assert travelled.returncode == 0, travelled.stderr[-3000:]
    assert travelled.stdout == single.stdout
    assert "weights: sent rank 1" in travelled.stderr
    (name,) = _cached(tmp_path, 1)
    assert ".L" in name


@pytest.mark.real
@pytest.mark.mpi
@pytest.mark.parametrize("n_ranks", [2, 3])
def test_real_qwen_from_three_parts_every_mode_gives_the_single_files_tokens(qwen_parts, n_ranks):
    """The demo target in 3 parts: iterative, speculative and PipeInfer (the Gemma draft, translated) on 2 and 3
    ranks give the single file's iterative tokens."""
    gemma = real_model("gemma3-270m")
    args = ["generate", "-q", "--json", "-p", "def quicksort(items):", "-n", "32", "--temp", "0", "-t", "1"]
    single = cli(args + ["--mode", "iterative", "-m", qwen_parts.one], n=2, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    want = json.loads(single.stdout.strip().splitlines()[-1])["tokens"]
    assert len(want) == 32
    for mode in ("iterative", "speculative", "pipeinfer"):
        draft = [] if mode == "iterative" else ["--draft", gemma]
        p = cli(args + ["--mode", mode, "-m", str(qwen_parts.parts[0])] + draft, n=n_ranks, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        got = json.loads(p.stdout.strip().splitlines()[-1])
        assert got["tokens"] == want, mode
        assert len(got["ranges"]) == n_ranks
