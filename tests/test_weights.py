"""Weights that travel: the stage file's layout (the bytes rank 0 streams), the weights cache of a host (keys, the
identity index, checks of a cached file, files nobody sees half-written), the disk check, the send order, the LRU
prune and `pipeinfer models cached|prune` (pure: no MPI; tests/test_weights_mpi.py runs the transfer)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from synth import make_llama_gguf
from pipeinfer.core import stagecache
from pipeinfer.core.stagecache import Item, Need
from pipeinfer.engine.stagefile import read_info, stage_layout, vocab_layout, whole_layout, write_stage_file


def _stream(layout, src, chunk: int) -> bytes:
    fd = os.open(src, os.O_RDONLY)
    out, off, buf = bytearray(), 0, np.empty(chunk, np.uint8)
    try:
        while off < layout.size:
            n = layout.read(fd, off, buf)
            out += buf[:n].tobytes()
            off += n
    finally:
        os.close(fd)
    return bytes(out)


@pytest.mark.parametrize("qtype", [None, "q8_0"])
@pytest.mark.parametrize("start, end, with_vocab", [(0, 2, False), (2, 4, True), (1, 3, False), (0, 4, True)])
def test_the_streamed_bytes_are_the_stage_file(tmp_path, qtype, start, end, with_vocab):
    src = make_llama_gguf(tmp_path / "m.gguf", n_layer=4, **({"qtype": qtype} if qtype else {}))
    write_stage_file(src, tmp_path / "s.gguf", start, end, with_vocab)
    layout = stage_layout(src, start, end, with_vocab)
    want = (tmp_path / "s.gguf").read_bytes()
    assert layout.size == len(want)
    for chunk in (1000, 4096, 1 << 20):  # chunk edges anywhere: inside the header, a tensor, the padding
        assert _stream(layout, src, chunk) == want


def test_a_vocabulary_file_and_a_whole_file(tmp_path):
    src = make_llama_gguf(tmp_path / "m.gguf", n_layer=4)
    vocab = tmp_path / "v.gguf"
    vocab.write_bytes(_stream(vocab_layout(src), src, 4096))
    assert read_info(vocab) == read_info(src)
    assert vocab.stat().st_size < src.stat().st_size / 10
    assert _stream(whole_layout(src), src, 3000) == src.read_bytes()


def _assemble(rc, src, layout, held_files: dict, chunk: int) -> tuple[bytes, int]:
    """What a receiver writes from rank 0's wire bytes (Recipe.pack on the source) and its held files
    (Recipe.unpack), chunk by chunk as ranks/weights.py does; and how many bytes travelled."""
    fd = os.open(src, os.O_RDONLY)
    fds = {name: os.open(path, os.O_RDONLY) for name, path in held_files.items()}
    out, wired, buf, wire, back = bytearray(), 0, np.empty(chunk, np.uint8), np.empty(chunk, np.uint8), \
        np.empty(chunk, np.uint8)
    try:
        for lo in range(0, layout.size, chunk):
            n = layout.read(fd, lo, buf)
            m = rc.pack(lo, buf[:n], wire)
            wired += m
            back[:n] = 0xAA  # whatever the buffer held before: unpack must write every byte
            rc.unpack(lo, wire[:m], fds, back[:n])
            out += back[:n].tobytes()
    finally:
        for f in (fd, *fds.values()):
            os.close(f)
    return bytes(out), wired


@pytest.mark.parametrize("start, end, with_vocab, held, kept_layers, kept_vocab", [
    (3, 6, True, [(2, 4, False)], 1, False),                # a re-form: the last stage grows into the lost one's
    (2, 6, True, [(0, 3, False), (4, 6, True)], 3, True),   # layers and the vocabulary from two held files
    (0, 2, False, [(4, 6, True)], 0, False),                # nothing in common but the small tensors of every stage
])
def test_a_host_that_holds_other_stages_gets_only_what_it_lacks(tmp_path, start, end, with_vocab, held, kept_layers,
                                                               kept_vocab):
    from pipeinfer.engine.stagefile import recipe
    src = make_llama_gguf(tmp_path / "m.gguf", n_layer=6, qtype="q8_0")
    files, layouts = {}, {}
    for a, b, v in held:
        name = f"L{a}-{b}{v}.gguf"
        write_stage_file(src, tmp_path / name, a, b, v)
        files[name], layouts[name] = tmp_path / name, stage_layout(src, a, b, v)
    write_stage_file(src, tmp_path / "want.gguf", start, end, with_vocab)
    want = (tmp_path / "want.gguf").read_bytes()
    layout = stage_layout(src, start, end, with_vocab)
    rc = recipe(layout, layouts)
    def source_bytes(a, b, v=False):
        return sum(p.nbytes for p in stage_layout(src, a, b, v).pieces if p.src_offset >= 0)
    one_layer = source_bytes(0, 2) - source_bytes(0, 1)
    vocab = source_bytes(0, 1, True) - source_bytes(0, 1)
    for chunk in (777, 4096, 1 << 20):
        got, wired = _assemble(rc, src, layout, files, chunk)
        assert got == want
        assert wired == rc.wire_bytes() == layout.size - sum(n for _, n, _, _ in rc.local)
    kept = rc.size - rc.wire_bytes()
    least = kept_layers * one_layer + kept_vocab * vocab
    assert least <= kept < least + one_layer  # those layers and the vocabulary (and the small tensors)
    assert recipe(layout, {}).wire_bytes() == layout.size  # a host holding nothing gets every byte


def test_holdings_are_the_models_other_stages_checked_whole(tmp_path):
    d = tmp_path / "w"
    ident = "ab" * 32
    want = Item(ident, 3, 6, True, 3)

    def put(item, data):
        path = _put(d, item, data)
        with stagecache.locked_index(d) as index:
            index["files"][item.file_name()]["digest"] = stagecache.file_digest(path)
        return path

    put(Item(ident, 2, 4, False, 3), os.urandom(1 << 20))          # overlaps: held
    put(Item(ident, 0, 2, True, 3), os.urandom(1 << 20))           # only the vocabulary in common: held
    put(Item(ident, 0, 2, False, 3), os.urandom(1 << 20))          # nothing in common
    put(Item(ident, 2, 4, False, 2), os.urandom(1 << 20))          # another stage format
    put(Item("cd" * 32, 2, 4, False, 3), os.urandom(1 << 20))      # another model
    put(Item(ident), os.urandom(1 << 20))                          # a whole file
    bad = put(Item(ident, 4, 5, False, 3), os.urandom(3 << 20))    # overlaps, but damaged in the middle below
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 1
    bad.write_bytes(bytes(data))
    assert stagecache.holdings(want, d) == ((Item(ident, 0, 2, True, 3).file_name(), 0, 2, True),
                                            (Item(ident, 2, 4, False, 3).file_name(), 2, 4, False))
    assert not bad.exists() and bad.name not in stagecache.read_index(d)["files"]  # never used, dropped
    assert stagecache.holdings(Item(ident), d) == ()


def test_items_are_named_by_content_range_vocabulary_and_format():
    a = Item("ab" * 32, 0, 14, False, 3)
    names = {a.file_name(), Item("ab" * 32, 0, 14, True, 3).file_name(), Item("ab" * 32, 0, 15, False, 3).file_name(),
             Item("ab" * 32, 0, 14, False, 4).file_name(), Item("cd" * 32, 0, 14, False, 3).file_name(),
             Item("ab" * 32).file_name(), Item("ab" * 32, -1, -1, True, 3).file_name()}
    assert len(names) == 7
    assert a.file_name() == "ab" * 16 + ".L0-14.novocab.s3.gguf"


def test_the_identity_is_hashed_once_and_again_when_the_file_changes(tmp_path):
    src = make_llama_gguf(tmp_path / "m.gguf", n_layer=2)
    d = tmp_path / "w"
    ident, dt = stagecache.model_identity(src, d)
    assert dt > 0 and ident == stagecache.file_digest(src)
    assert stagecache.model_identity(src, d) == (ident, 0.0)
    data = bytearray(src.read_bytes())
    data[-1] ^= 1
    time.sleep(0.01)
    src.write_bytes(bytes(data))
    ident2, dt2 = stagecache.model_identity(src, d)
    assert dt2 > 0 and ident2 != ident
    assert len(stagecache.read_index(d)["identity"]) == 1  # the path's old identity is forgotten


def _put(d: Path, item: Item, data: bytes) -> Path:
    f = stagecache.IncomingFile(d, item.file_name())
    f.write(data)
    path = f.commit()
    stagecache.record(item, path, stagecache.content_hash(data).hexdigest(), "m.gguf", d)
    return path


def test_a_cached_file_cut_short_or_overwritten_is_dropped(tmp_path):
    d = tmp_path / "w"
    item = Item("ab" * 32, 0, 2, False, 3)
    data = os.urandom(3 << 20)
    path = _put(d, item, data)
    assert stagecache.cached(item, d=d) == path
    assert stagecache.cached(item, size=len(data) + 1, d=d) is None  # not the size rank 0 sends: fetched again
    assert not path.exists()
    path = _put(d, item, data)
    path.write_bytes(data[: len(data) // 2])  # cut short
    assert stagecache.cached(item, d=d) is None and not path.exists()
    path = _put(d, item, data)
    path.write_bytes(b"\0" * 10 + data[10:])  # another file of the same size
    assert stagecache.cached(item, d=d) is None
    assert stagecache.listing(d) == []
    path = _put(d, item, data)
    with open(path, "r+b") as f:  # damaged in its middle only: the sampled first and last MiB unchanged
        f.seek(len(data) // 2)
        f.write(b"\0" * 16)
    assert stagecache.cached(item, d=d) is None and not path.exists()  # written since indexed: checked whole
    path = _put(d, item, data)
    os.utime(path, ns=(1, 1))  # touched, not changed: checked whole once, then kept
    assert stagecache.cached(item, d=d) == path and stagecache.cached(item, d=d) == path


def test_nothing_half_written_is_left_by_a_writer_that_dies(tmp_path):
    d = tmp_path / "w"
    code = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
            f"from pathlib import Path\nfrom pipeinfer.core.stagecache import IncomingFile\n"
            f"f = IncomingFile(Path({str(d)!r}), 'x.gguf'); f.write(b'a' * 100000); print('written', flush=True)\n"
            f"time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "written"
    p.send_signal(signal.SIGKILL)
    p.wait()
    stagecache.sweep_partials(d)
    assert [x.name for x in d.iterdir() if not x.name.startswith(".")] == []


def test_a_discarded_or_partial_file_leaves_nothing(tmp_path, monkeypatch):
    d = tmp_path / "w"
    f = stagecache.IncomingFile(d, "a.gguf")
    f.write(b"abc")
    f.discard()
    monkeypatch.setattr(os, "O_TMPFILE", None, raising=False)  # a file system without O_TMPFILE: a named .partial
    f = stagecache.IncomingFile(d, "b.gguf")
    assert f.partial is not None and f.partial.exists()
    f.write(b"abc")
    assert f.commit() == d / "b.gguf" and (d / "b.gguf").read_bytes() == b"abc"
    stale = d / f"c.gguf.999999999{stagecache.PARTIAL}"  # a writer long gone
    stale.write_bytes(b"x")
    assert stagecache.sweep_partials(d) == [stale]
    assert sorted(x.name for x in d.iterdir() if not x.name.startswith(".")) == ["b.gguf"]


def test_the_disk_check_names_the_host_what_it_needs_and_has():
    needs = [Need(0, "h0", "none"), Need(1, "h1", "need", 10**9, "/c1"), Need(2, "h1", "need", 10**9, "/c1"),
             Need(3, "h2", "cached", 0, "/c2")]
    assert stagecache.disk_shortfall(needs, {1: 4 * 10**8, 2: 5 * 10**8}) is None
    msg = stagecache.disk_shortfall(needs, {1: 6 * 10**8, 2: 5 * 10**8})  # two ranks of one host add up
    assert msg.startswith("host h1 has no room") and "1.1 GB in /c1" in msg and "has 1.0 GB free" in msg
    assert "\n" not in msg


def test_send_order_largest_first_only_those_that_need():
    needs = [Need(0, "h0", "none"), Need(1, "h1", "need"), Need(2, "h2", "need"), Need(3, "h3", "cached")]
    assert stagecache.send_order(needs, {1: 100, 2: 500}) == [2, 1]
    assert stagecache.send_order(needs, {1: 500, 2: 500}) == [1, 2]


def test_prune_least_recently_used_to_a_bound_or_one_model():
    files = {"a": {"size": 100, "last_use": 3, "model": "aaa1", "model_name": "q.gguf"},
             "b": {"size": 200, "last_use": 1, "model": "bbb2", "model_name": "g.gguf"},
             "c": {"size": 300, "last_use": 2, "model": "aaa1", "model_name": "q.gguf"}}
    assert stagecache.prune_plan(files, bound=400) == ["b"]
    assert stagecache.prune_plan(files, bound=350) == ["b", "c"]
    assert stagecache.prune_plan(files, bound=600) == []
    assert stagecache.prune_plan(files, bound=0) == ["b", "c", "a"]
    assert stagecache.prune_plan(files, model="aaa") == ["a", "c"]
    assert stagecache.prune_plan(files, model="g.gguf") == ["b"]


def test_sizes_and_progress_line():
    assert stagecache.parse_size("20G") == 20 << 30 and stagecache.parse_size("1.5GB") == int(1.5 * (1 << 30))
    assert stagecache.parse_size("123") == 123 and stagecache.parse_size("500MiB") == 500 << 20
    line = stagecache.progress_line("rank 1 (h1)", 125_000_000, 500_000_000, 1.0)
    assert line == "rank 1 (h1): 125.0 MB of 500.0 MB, 125.0 MB/s, 3.0 s left"


def test_models_cached_and_prune(tmp_path, monkeypatch):
    from pipeinfer.cli.main import main
    monkeypatch.setenv("PIPEINFER_WEIGHTS_CACHE", str(tmp_path / "w"))
    d = tmp_path / "w"
    a = _put(d, Item("aa" * 32, 0, 2, False, 3), b"a" * 3000)
    time.sleep(0.01)
    _put(d, Item("bb" * 32, 2, 4, True, 3), b"b" * 5000)
    r = CliRunner().invoke(main, ["models", "cached"])
    assert r.exit_code == 0, r.output
    assert "layers 0-1" in r.output and "m.gguf" in r.output and "8.0 kB" in r.output
    r = CliRunner().invoke(main, ["models", "prune", "--max-size", "6000"])
    assert r.exit_code == 0, r.output
    assert not a.exists() and "1 file" in r.output
    r = CliRunner().invoke(main, ["models", "prune", "--model", "bb"])
    assert r.exit_code == 0 and stagecache.listing(d) == []
    r = CliRunner().invoke(main, ["models", "prune"])
    assert r.exit_code != 0  # what to prune must be said


def _arch_names():
    from synth_arch import VARIANTS
    return sorted(VARIANTS)


@pytest.mark.parametrize("name", _arch_names())
def test_the_fast_header_reader_lays_out_the_same_bytes_for_every_architecture(tmp_path, name):
    """Rank 0 lays out stage files from the fast header reader (HeaderReader: raw key-value bytes, no numpy view per
    vocabulary string); the bytes are the ones gguf.GGUFReader's path writes, every split rule included."""
    from synth_arch import make_arch_gguf
    from pipeinfer.engine.stagefile import HeaderReader, StageFileError
    src = make_arch_gguf(tmp_path / "m.gguf", name)
    n = read_info(src).n_layer
    reader = HeaderReader(src)
    for start, end, with_vocab in [(0, n // 2, False), (n // 2, n, True), (1, n - 1, False)]:
        try:
            write_stage_file(src, tmp_path / "s.gguf", start, end, with_vocab)
        except StageFileError:
            continue  # a range this architecture refuses (deepseek2's lite sizes)
        assert _stream(stage_layout(src, start, end, with_vocab, reader=reader), src, 1 << 16) == \
            (tmp_path / "s.gguf").read_bytes(), (start, end, with_vocab)
    assert _stream(vocab_layout(src, reader=reader), src, 4096) == _stream(vocab_layout(src), src, 4096)


def test_a_cache_indexed_with_another_hash_is_emptied_not_trusted(tmp_path):
    d = tmp_path / "w"
    item = Item("ab" * 32, 0, 2, False, 3)
    path = _put(d, item, os.urandom(1 << 20))
    index = json.loads((d / "index.json").read_text())
    index.pop("hash")  # as a pipeinfer that named files by sha256 wrote it
    index["files"][item.file_name()]["sha256"] = index["files"][item.file_name()].pop("digest")
    (d / "index.json").write_text(json.dumps(index))
    assert stagecache.read_index(d)["files"] == {} and path.exists()  # reading deletes nothing
    assert stagecache.cached(Item("cd" * 32, 0, 2, False, 3), d=d) is None  # the first use of the cache empties it
    assert not path.exists() and stagecache.read_index(d)["files"] == {}
    assert stagecache.read_index(d)["hash"] == stagecache.HASH
