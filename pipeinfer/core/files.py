"""Files every part shares: the cache roots, derived-file paths, atomic writes, the prompt files.

The cache (``$PIPEINFER_CACHE`` or ``~/.cache/pipeinfer``) holds fetched models (``models/``). Files derived from
them (``stages/``: stage files, pruned heads, exact-batch probes, prefix indexes, each keyed by its source's
identity so a changed source is never served a stale file) and weights received from another host (``weights/``)
go under the node cache: the same folder, except in a Slurm job without ``$PIPEINFER_CACHE``, where they go to
the node-local scratch (``$SLURM_TMPDIR``, else ``$TMPDIR``), not to a home directory that is usually NFS with a
quota.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Mapping

# prompts/ beside the package: the benchmark prompts (code, story, encyclopedia)
PROMPTS_DIR = Path(__file__).resolve().parents[2] / "prompts"


def cache_dir() -> Path:
    """The pipeinfer cache root: ``$PIPEINFER_CACHE`` or ``~/.cache/pipeinfer``."""
    env = os.environ.get("PIPEINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pipeinfer"


def node_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The root of this node's derived and received files: ``$PIPEINFER_CACHE`` when set; in a Slurm job
    (SLURM_JOB_ID) ``$SLURM_TMPDIR/pipeinfer``, else ``$TMPDIR/pipeinfer`` (the first of them that is a folder);
    else ``cache_dir()``."""
    environ = os.environ if environ is None else environ
    if not environ.get("PIPEINFER_CACHE") and environ.get("SLURM_JOB_ID"):
        for scratch in (environ.get("SLURM_TMPDIR"), environ.get("TMPDIR")):
            if scratch and Path(scratch).expanduser().is_dir():
                return Path(scratch).expanduser() / "pipeinfer"
    return cache_dir()


def stage_cache_dir() -> Path:
    """Where derived files live: ``$PIPEINFER_STAGE_CACHE`` or ``node_cache_dir() / "stages"``."""
    env = os.environ.get("PIPEINFER_STAGE_CACHE")
    return Path(env) if env else node_cache_dir() / "stages"


def derived_path(src: str | os.PathLike, label: str, ext: str, *key: object) -> Path:
    """Cache path of a file derived from src: keyed by src's identity (path, size, mtime) and `key`."""
    st = os.stat(src)
    text = "|".join(map(str, (os.path.abspath(src), st.st_size, st.st_mtime_ns, *key)))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return stage_cache_dir() / f"{Path(src).stem}.{label}.{digest}.{ext}"


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(a temporary file beside path), then rename it onto path: ranks sharing the cache never read
    a partial file. The temporary name keeps path's suffix (numpy's savez would add its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_prompt_file(path: str | os.PathLike) -> tuple[str, bool | None]:
    """Prompt text and its '# chat: true|false' header (None when absent)."""
    text = Path(path).read_text()
    chat = None
    first, _, rest = text.partition("\n")
    if first.strip().lower().startswith("# chat:"):
        chat = first.split(":", 1)[1].strip().lower() in ("true", "yes", "1")
        text = rest
    return text, chat


def prompt_path(name: str) -> Path:
    """prompts/NAME.txt (--prompt-name)."""
    return PROMPTS_DIR / f"{name}.txt"
