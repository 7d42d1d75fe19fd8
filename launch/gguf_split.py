"""llama.cpp's own gguf-split (`llama-gguf-split`), built from the installed llama-cpp-python's vendored llama.cpp: what
writes the split GGUFs (NAME-00001-of-0000N.gguf) the tests read, as users' large models are published.

The sdist of the installed llama-cpp-python version (`pip download --no-binary :all:`) carries llama.cpp's source;
it is unpacked into $PIPEINFER_CACHE/peers/ (~/.cache/pipeinfer/peers), where launch/bench/bench_peers.py unpacks and
builds llama.cpp's programs too. gguf-split needs only the gguf API (libggml-base), libllama's split-path helpers
and the build-info functions of llama.cpp's `common`, so one g++ call compiles tools/gguf-split/gguf-split.cpp with a
build-info of its own against the shared libraries the installed llama_cpp package ships (llama_cpp/lib): a few
seconds, against ten minutes for llama.cpp's CMake build. The binary is cached beside the source, keyed by the
version and that lib folder.

    from gguf_split import split_gguf          # launch/ on sys.path (tests/helpers.py puts it there)
    parts = split_gguf(model, out_dir / "m", max_tensors=120)   # [m-00001-of-00003.gguf, ...]
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path


class ToolUnavailable(RuntimeError):
    """The sdist or a C++ compiler cannot be had here (one line: what is missing)."""


def peers_home() -> Path:
    return Path(os.environ.get("PIPEINFER_CACHE", Path.home() / ".cache" / "pipeinfer")) / "peers"


def vendored_llama_cpp() -> Path:
    """The vendored llama.cpp source of the installed llama-cpp-python, unpacked from its sdist once."""
    version = metadata.version("llama_cpp_python")
    home = peers_home()
    src = home / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if src.is_dir():
        return src
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                              "--disable-pip-version-check", f"llama-cpp-python=={version}", "-d", tmp],
                             capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if got.returncode != 0 or not sdists:
            tail = (got.stdout + got.stderr).strip().splitlines()[-1:] or ["no sdist"]
            raise ToolUnavailable(f"llama-cpp-python {version}'s sdist cannot be downloaded: {tail[0]}")
        unpack = Path(tempfile.mkdtemp(prefix=".unpack-", dir=home))
        try:
            subprocess.run(["tar", "xzf", str(sdists[0]), "-C", str(unpack)], check=True, capture_output=True)
            os.replace(unpack / f"llama_cpp_python-{version}", home / f"llama_cpp_python-{version}")
        finally:
            shutil.rmtree(unpack, ignore_errors=True)
    return src


def _lib_dir() -> Path:
    import llama_cpp
    return Path(llama_cpp.__file__).resolve().parent / "lib"


def gguf_split_binary() -> Path:
    """The path of llama-gguf-split, compiled on first use (ToolUnavailable when it cannot be)."""
    version, lib = metadata.version("llama_cpp_python"), _lib_dir()
    key = hashlib.sha256(str(lib).encode()).hexdigest()[:12]
    out = peers_home() / f"gguf-split-{version}-{key}" / "llama-gguf-split"
    if out.is_file() and subprocess.run([str(out), "--help"], capture_output=True).returncode == 0:
        return out
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        raise ToolUnavailable("no C++ compiler (g++) to build llama.cpp's gguf-split")
    src = vendored_llama_cpp()
    out.parent.mkdir(parents=True, exist_ok=True)
    info = out.parent / "build-info.cpp"
    template = (src / "common" / "build-info.cpp.in").read_text()
    for name, value in (("LLAMA_BUILD_NUMBER", "0"), ("LLAMA_BUILD_COMMIT", f"llama-cpp-python-{version}"),
                        ("BUILD_COMPILER", Path(cxx).name), ("BUILD_TARGET", "host")):
        template = template.replace(f"@{name}@", value)
    info.write_text(template)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    cmd = [cxx, "-std=c++17", "-O1", f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", f"-I{src / 'common'}",
           str(src / "tools" / "gguf-split" / "gguf-split.cpp"), str(info), f"-L{lib}", "-lllama", "-lggml-base",
           "-lggml", f"-Wl,-rpath,{lib}", "-o", str(tmp)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    if built.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling gguf-split failed:\n{built.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


def split_gguf(src: str | os.PathLike, prefix: str | os.PathLike, max_tensors: int) -> list[Path]:
    """Split src with llama.cpp's gguf-split into parts of at most max_tensors tensors, named
    PREFIX-0000k-of-0000n.gguf; returns their paths in order."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([str(gguf_split_binary()), "--split", "--split-max-tensors", str(max_tensors), str(src),
                          str(prefix)], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"gguf-split failed ({run.returncode}): {run.stderr[-2000:]}")
    return sorted(prefix.parent.glob(f"{prefix.name}-*-of-*.gguf"))
