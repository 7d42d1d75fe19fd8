"""MPI launchers: which MPI runs here, hostfiles, and the mpiexec/mpirun command line of a pipeinfer job.

The `pipeinfer launch` command (cli/launch.py) and the supervisor (supervisor/supervisor.py) build their jobs here;
every rank checks its world against what its launcher started (world_size_mismatch) here too.

Hostfile format
---------------
One host per line, in a form that both MPICH (Hydra) and Open MPI accept::

    HOST                 # one slot
    HOST:SLOTS           # MPICH spelling
    HOST slots=SLOTS     # Open MPI spelling (max_slots=M is accepted and ignored)

Per-host pipeinfer settings go in a trailing comment so the file stays a valid
hostfile for either MPI::

    node1:2 # pipeinfer: threads=8 threads_batch=16 weight=2.0

Keys: ``threads`` and ``threads_batch`` (positive integers, per rank on that
host), ``weight`` (positive number, the relative share of layers each rank
on that host gets), ``mem`` (GiB the host can give pipeinfer: a supervised
server checks it before re-forming its job on fewer hosts) and ``role`` (``stage``, the default, or ``draft``: the
host that runs the draft model on a rank of its own, ``--draft-at rank``; at
most one, with one slot; it becomes the last rank wherever its line is, and
its ``threads`` become ``--draft-threads``). ``cores``, ``mem_bw`` (GB/s),
``disk`` (GiB), ``link`` (Mbit/s) and ``speed`` describe a machine to
``pipeinfer plan`` (twin/machines.py); nothing else reads them. Blank lines, whole-line comments and trailing comments
that do not start with ``pipeinfer:`` are ignored. Any other line is a
``ValueError`` naming the line number.

Ranks are placed host by host: the first host's slots get ranks 0..s0-1, the
next host's the following ranks, and so on (MPICH's default for ``host:N``,
Open MPI's ``--map-by slot``). ``np`` may not exceed the total slots.

Command lines
-------------
MPICH::

    mpiexec -f HOSTFILE -n NP [-genvlist A,B] -wdir / -genv PIPEINFER_WORKDIR CWD PYTHON -m mpi4py -m pipeinfer ARGS

(Hydra would start every rank in CWD, the folder the job is launched from, and fail on a host without it: the
ranks start in /, and each goes back to CWD where its host has it, else to its home folder.)

Open MPI (``mpiexec`` and ``mpirun`` are the same program there)::

    mpirun --hostfile HOSTFILE --np NP --bind-to none --map-by slot [-x A -x B] \
        PYTHON -m mpi4py -m pipeinfer ARGS

HOSTFILE is a translation of the user's hostfile into that MPI's own spelling
(``write_hostfile``), one line per host: the lines naming one host are merged
(Open MPI refuses a host listed twice), the first of them placing it.

Which MPI: the one whose library mpi4py loads here (``mpi4py_library`` asks
mpi4py in a subprocess with this environment: the mpich wheel's MPICH by
default, Open MPI with ``MPI4PY_MPIABI=openmpi``). The launcher is looked for
beside that library, beside this Python, then on PATH, and must be of the
same MPI (``choose_launcher``); a launcher of another MPI (``--mpiexec``) is
refused, since every rank would run as a separate one-process job.
``MPI4PY_*`` is forwarded, so every rank loads the same MPI.

Signals: a first Ctrl-C or SIGTERM asks the job to stop cleanly. MPICH's
mpiexec gets the same signal and forwards it to every rank; Open MPI's mpirun
gets SIGUSR1, which it forwards as it is (its own Ctrl-C handling would kill
the ranks 1 s after its SIGTERM). A second one ends the job the MPI's way.

Per-host settings become pipeinfer options, one value
per rank, appended to ARGS unless ARGS already has them: ``--threads a,b,..``,
``--threads-batch a,b,..`` and ``--layer-split w0,w1,..`` (weights normalised
to sum to 1; hosts without a weight count 1.0), over the target's ranks only;
a draft host adds ``--draft-at rank`` and ``--draft-threads``.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Collection, Iterable, Mapping, Sequence

from . import container


__all__ = [
    "Host", "parse_hostfile", "parse_hostfile_text", "detect_mpi", "mpi_from_version",
    "write_hostfile", "format_hostfile", "rank_hosts", "settings_args", "host_settings", "option_args",
    "build_command",
    "DEFAULT_ENV_FORWARD", "MpiLibrary", "mpi4py_library", "choose_launcher",
]

MPI_KINDS = ("mpich", "openmpi")
ROLES = ("stage", "draft")

#: Environment variables forwarded to every rank (only those that are set; glob patterns allowed).
DEFAULT_ENV_FORWARD: tuple[str, ...] = (
    "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "OMP_NUM_THREADS", "PIPEINFER_*", "GGML_*", "LLAMA_*",
    "MPI4PY_*",
)


@dataclass(frozen=True)
class Host:
    """One hostfile line: host name, MPI slots and optional per-rank settings."""

    name: str
    slots: int = 1
    threads: int | None = None
    threads_batch: int | None = None
    weight: float | None = None
    mem: float | None = None  # GiB this host can give pipeinfer (the supervisor's check before a re-form)
    role: str = "stage"  # stage | draft
    group: str | None = None  # consecutive ranks whose hosts name one group form a stage's tensor group (--groups)
    # a machine described for `pipeinfer plan` (twin/machines.py); launch and the supervisor ignore these
    cores: int | None = None      # physical cores
    mem_bw: float | None = None   # memory bandwidth, GB/s
    disk: float | None = None     # GiB free where pipeinfer keeps its stage files
    link: float | None = None     # Mbit/s of its network link
    speed: float | None = None    # one core's decode speed relative to a core of the profiled host

DESCRIBE_KEYS = ("cores", "mem_bw", "disk", "link", "speed")


_COLON = re.compile(r"^([A-Za-z0-9_.\-]+)(?::(\d+))?$")
_SLOTS_KV = re.compile(r"^(slots|max_slots|max-slots)=(\d+)$")


def _positive_int(value: str, key: str, where: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{where}: {key}={value!r} is not an integer") from None
    if n <= 0:
        raise ValueError(f"{where}: {key} must be positive, got {n}")
    return n


def _parse_settings(text: str, where: str) -> dict:
    settings: dict = {}
    for item in text.split():
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise ValueError(f"{where}: expected key=value in pipeinfer comment, got {item!r}")
        if key in ("threads", "threads_batch", "cores"):
            settings[key] = _positive_int(value, key, where)
        elif key in ("weight", "mem", "mem_bw", "disk", "link", "speed"):
            try:
                w = float(value)
            except ValueError:
                raise ValueError(f"{where}: {key}={value!r} is not a number") from None
            if not w > 0 or w == float("inf"):
                raise ValueError(f"{where}: {key} must be a positive finite number, got {value}")
            settings[key] = w
        elif key == "group":
            settings[key] = value
        elif key == "role":
            if value not in ROLES:
                raise ValueError(f"{where}: unknown role {value!r} (known: {', '.join(ROLES)})")
            settings[key] = value
        else:
            raise ValueError(f"{where}: unknown pipeinfer setting {key!r} "
                             "(known: threads, threads_batch, weight, mem, role, group, cores, mem_bw, disk, link, speed)")
    return settings


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[Host]:
    """Parse hostfile text (format in the module docstring) into ``Host`` objects."""
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        where = f"{source}:{lineno}"
        body, hash_, comment = raw.partition("#")
        body = body.strip()
        if not body:
            continue  # blank line or whole-line comment
        settings: dict = {}
        comment = comment.strip()
        if hash_ and comment.startswith("pipeinfer:"):
            settings = _parse_settings(comment[len("pipeinfer:"):], where)
        tokens = body.split()
        m = _COLON.match(tokens[0])
        if not m:
            raise ValueError(f"{where}: bad host entry {tokens[0]!r}")
        name, slots = m.group(1), (int(m.group(2)) if m.group(2) else None)
        for tok in tokens[1:]:
            kv = _SLOTS_KV.match(tok)
            if not kv:
                raise ValueError(f"{where}: unexpected {tok!r} (expected slots=N)")
            if kv.group(1) != "slots":
                continue  # max_slots: accepted, irrelevant here
            if slots is not None:
                raise ValueError(f"{where}: slots given twice")
            slots = int(kv.group(2))
        if slots is None:
            slots = 1
        if slots <= 0:
            raise ValueError(f"{where}: slots must be positive, got {slots}")
        hosts.append(Host(name, slots, **settings))
    if not hosts:
        raise ValueError(f"{source}: no hosts")
    drafts = [h for h in hosts if h.role == "draft"]
    if len(drafts) > 1:
        raise ValueError(f"{source}: {len(drafts)} hosts have role=draft ({', '.join(h.name for h in drafts)}); "
                         f"the draft runs on one rank")
    if drafts and drafts[0].slots != 1:
        raise ValueError(f"{source}: the draft host {drafts[0].name} has {drafts[0].slots} slots; it runs one rank")
    if drafts and len(drafts) == len(hosts):
        raise ValueError(f"{source}: only a draft host; the target's stages need at least one host")
    return hosts


def hostfile_text(hosts: Sequence[Host]) -> str:
    """Hosts as a hostfile of this format, their settings kept (what parse_hostfile_text reads back)."""
    def line(h: Host) -> str:
        settings = [f"{k}={_fmt_weight(v) if isinstance(v, float) else v}"
                    for k, v in (("threads", h.threads), ("threads_batch", h.threads_batch), ("weight", h.weight),
                                 ("mem", h.mem), ("role", None if h.role == "stage" else h.role), ("group", h.group))
                    + tuple((k, getattr(h, k)) for k in DESCRIBE_KEYS) if v is not None]
        return f"{h.name}:{h.slots}" + (" # pipeinfer: " + " ".join(settings) if settings else "") + "\n"
    return "".join(line(h) for h in hosts)


def parse_hostfile(path: str | os.PathLike) -> list[Host]:
    """Read and parse a hostfile (see ``parse_hostfile_text``)."""
    return parse_hostfile_text(Path(path).read_text(), source=str(path))


def mpi_from_version(text: str) -> str:
    """Return "mpich" or "openmpi" from ``mpiexec --version`` output; ValueError otherwise."""
    if re.search(r"open\s*mpi|openrte|open-rte|\bprrte\b", text, re.I):
        return "openmpi"
    if re.search(r"hydra", text, re.I):
        return "mpich"  # MPICH, MVAPICH and Intel MPI all use Hydra
    raise ValueError(f"cannot tell which MPI this is from: {text.strip()[:200]!r}")


def detect_mpi(mpiexec: str = "mpiexec") -> str:
    """Run ``MPIEXEC --version`` and return "mpich" or "openmpi"."""
    try:
        proc = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"cannot run {mpiexec} --version: {exc}") from exc
    try:
        return mpi_from_version(proc.stdout + "\n" + proc.stderr)
    except ValueError as exc:
        raise RuntimeError(f"{mpiexec}: {exc}") from None


# ---------------------------------------------------------------- which MPI: the library mpi4py loads, and its launcher
@dataclass(frozen=True)
class MpiLibrary:
    """The MPI library that mpi4py loads in a given environment."""
    kind: str | None   # "mpich" or "openmpi" (mpi_library), None: another MPI
    name: str          # e.g. "Open MPI 4.1.4"
    path: str | None   # the shared library file, where the system says (Linux: /proc/self/maps)


# asks mpi4py without initialising MPI (MPI_Get_library_version may be called before MPI_Init)
_LIBRARY_PROBE = """\
import json, mpi4py
mpi4py.rc.initialize = mpi4py.rc.finalize = False
from mpi4py import MPI
try:
    maps = [line.split()[-1] for line in open('/proc/self/maps') if '/libmpi.so' in line]
except OSError:
    maps = []
print(json.dumps([MPI.Get_library_version(), maps[0] if maps else None]))
"""


def mpi4py_library(python: str = sys.executable, environ: Mapping[str, str] | None = None) -> MpiLibrary:
    """Ask mpi4py, in `python` with `environ` (the ranks' environment), which MPI library it loads."""
    try:
        proc = subprocess.run([python, "-c", _LIBRARY_PROBE], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ if environ is None else environ))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"cannot ask mpi4py which MPI library it loads ({python}): {exc}") from None
    try:
        version, path = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = (proc.stderr.strip().splitlines() or ["no answer"])[-1]
        raise RuntimeError(f"cannot ask mpi4py which MPI library it loads ({python}): {why}") from None
    kind, name = mpi_library(version)
    return MpiLibrary(kind, name, path)


def _launcher_dirs(library: MpiLibrary, python: str) -> list[Path]:
    """Where a launcher of `library` is most likely: the bin/ of the prefix the library was installed in
    (/usr/lib/x86_64-linux-gnu/libmpi.so.40 -> /usr/bin), then beside this Python (the mpich wheel's mpiexec)."""
    dirs = []
    if library.path:
        lib = Path(library.path).parent
        prefix = next((p.parent for p in [lib, *lib.parents] if p.name in ("lib", "lib64")), lib.parent)
        dirs.append(prefix / "bin")
    dirs.append(Path(python).parent)
    return dirs


def launcher_candidates(library: MpiLibrary, python: str, path_env: str | None) -> list[str]:
    """Launchers that may belong to `library`, most likely first (see _launcher_dirs; then PATH), each once."""
    names = {"openmpi": ("mpirun", "mpiexec", "mpirun.openmpi", "mpiexec.openmpi"),
             "mpich": ("mpiexec", "mpiexec.hydra", "mpirun", "mpiexec.mpich", "mpirun.mpich")}[library.kind]
    found = [str(d / n) for d in _launcher_dirs(library, python) for n in names if os.access(d / n, os.X_OK)]
    found += [w for n in names if (w := shutil.which(n, path=path_env))]
    return list(dict.fromkeys(found))


def choose_launcher(library: MpiLibrary, requested: str | None = None, *, python: str = sys.executable,
                    path_env: str | None = None) -> str:
    """The launcher (mpiexec/mpirun) of the MPI that mpi4py loads: `requested` (--mpiexec) when it is of that MPI,
    else the first candidate that is. RuntimeError (one line) when none is, or when `requested` is of another MPI:
    its ranks would each run as a job of one process."""
    if library.kind is None:
        raise RuntimeError(f"mpi4py loads {library.name}, an MPI that `pipeinfer launch` does not know: run its "
                           f"mpiexec yourself (see docs/cluster.md)")
    where = f"{library.name} ({library.path})" if library.path else library.name
    if requested:
        kind = detect_mpi(requested)
        if kind != library.kind:
            raise RuntimeError(f"{requested} is {MPI_NAMES[kind]}'s launcher but mpi4py loads {where}: every rank would "
                               f"run as a separate one-process job; give {MPI_NAMES[library.kind]}'s mpiexec, or "
                               f"make mpi4py load {MPI_NAMES[kind]} ({HOW_TO_LOAD[kind]})")
        return requested
    tried = launcher_candidates(library, python, path_env)
    for cand in tried:
        try:
            if detect_mpi(cand) == library.kind:
                return cand
        except RuntimeError:
            continue
    raise RuntimeError(f"mpi4py loads {where} but no launcher of it was found (tried: {', '.join(tried) or 'none'}): "
                       f"install it or give --mpiexec")


MPI_NAMES = {"mpich": "MPICH", "openmpi": "Open MPI"}
HOW_TO_LOAD = {"openmpi": "export MPI4PY_MPIABI=openmpi",
                "mpich": "unset MPI4PY_MPIABI, or MPI4PY_LIBMPI=/path/to/libmpi.so.12"}


def group_hosts(hosts: Sequence[Host]) -> list[Host]:
    """The lines naming one host brought together where the host first appears (a host's ranks are consecutive, as
    Open MPI places them); otherwise in the hostfile's order."""
    first = {name: i for i, name in reversed(list(enumerate(h.name for h in hosts)))}
    return sorted(hosts, key=lambda h: first[h.name])  # stable: a host's lines keep their order


def merged_slots(hosts: Sequence[Host]) -> list[tuple[str, int]]:
    """(host, slots) for each run of consecutive lines naming one host: one hostfile line per run."""
    runs: list[tuple[str, int]] = []
    for h in hosts:
        if runs and runs[-1][0] == h.name:
            runs[-1] = (h.name, runs[-1][1] + h.slots)
        else:
            runs.append((h.name, h.slots))
    return runs


def format_hostfile(hosts: Sequence[Host], mpi: str) -> str:
    """Hostfile text in MPI's own spelling (no pipeinfer comments), the hosts in rank order, one line per host."""
    if mpi not in MPI_KINDS:
        raise ValueError(f"unknown MPI {mpi!r} (expected one of {MPI_KINDS})")
    runs = merged_slots(hosts)
    names = [name for name, _ in runs]
    apart = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if apart and mpi == "openmpi":
        # only the draft host can be here: it runs the last rank, and stage ranks before another host's
        raise ValueError(f"host {apart} would run ranks that are not consecutive (stage ranks, then the draft's, "
                         f"the last): Open MPI places a host's ranks together; list {apart}'s stage line last")
    spelling = "{}:{}" if mpi == "mpich" else "{} slots={}"
    return "".join(spelling.format(name, slots) + "\n" for name, slots in runs)


def write_hostfile(hosts: Sequence[Host], mpi: str, path: str | os.PathLike) -> Path:
    """Write ``format_hostfile(hosts, mpi)`` to ``path`` and return it."""
    path = Path(path)
    path.write_text(format_hostfile(hosts, mpi))
    return path


def rank_hosts(hosts: Sequence[Host], np: int) -> list[Host]:
    """The host of each rank 0..np-1, filling each host's slots in order."""
    total = sum(h.slots for h in hosts)
    if np < 1:
        raise ValueError(f"np must be >= 1, got {np}")
    if np > total:
        raise ValueError(f"np={np} exceeds the {total} slots in the hostfile")
    ranks = [h for h in hosts for _ in range(h.slots)]
    return ranks[:np]


# the options a hostfile's settings may give (command-line names, as core/config.OPTION_FIELDS and set_by_user name
# them); an option the user set wins over them
HOST_SET_OPTIONS = ("threads", "threads_batch", "layer_split", "draft_at", "draft_threads", "groups",
                    "tensor_parallel")
_SHORT = {"threads": "-t", "threads_batch": "-tb"}  # their short spellings (cli/options.py)


def options_given(args: Sequence[str]) -> frozenset[str]:
    """The HOST_SET_OPTIONS a pipeinfer command line sets (before a literal "--"), long or short (-t 8, -t8): what
    `pipeinfer launch` knows of the command it runs; `serve`/`generate --hostfile` know it from click
    (Config.set_by_user)."""
    given = set()
    for a in args:
        if a == "--":
            break
        for name in HOST_SET_OPTIONS:
            option, short = "--" + name.replace("_", "-"), _SHORT.get(name)
            if a == option or a.startswith(option + "=") or (short and (a == short or (
                    a.startswith(short) and a[len(short):][:1].isdigit()))):
                given.add(name)
    return frozenset(given)


def _fmt_weight(w: float) -> str:
    return f"{w:.6f}".rstrip("0").rstrip(".") or "0"


def host_settings(hosts: Sequence[Host], np: int, given: Collection[str] = ()) -> dict[str, str]:
    """The run's options (command-line names: Config.with_options) that per-host settings give and the user did not
    set (`given`: the same names): threads=, threads_batch= and weight= (as --layer-split fractions), one value per
    rank."""
    per_rank = rank_hosts(hosts, np)
    out: dict[str, str] = {}
    if any(h.threads for h in per_rank) and "threads" not in given:
        missing = sorted({h.name for h in per_rank if h.threads is None})
        if missing:
            raise ValueError(f"threads= is set on some hosts but not on {', '.join(missing)}")
        out["threads"] = ",".join(str(h.threads) for h in per_rank)
    if any(h.threads_batch for h in per_rank) and "threads_batch" not in given:
        tb = [h.threads_batch or h.threads for h in per_rank]
        missing = sorted({h.name for h, v in zip(per_rank, tb) if v is None})
        if missing:
            raise ValueError(f"threads_batch= (or threads=) missing on {', '.join(missing)}")
        out["threads_batch"] = ",".join(str(v) for v in tb)
    sizes = group_runs(per_rank)
    if any(s > 1 for s in sizes) and not {"groups", "tensor_parallel"} & set(given):
        out["groups"] = ",".join(map(str, sizes))
    if any(h.weight is not None for h in per_rank) and "layer_split" not in given:
        leaders = [per_rank[sum(sizes[:k])] for k in range(len(sizes))]  # a group's stage: its first host's weight
        ws = [1.0 if h.weight is None else h.weight for h in leaders]
        total = sum(ws)
        out["layer_split"] = ",".join(_fmt_weight(w / total) for w in ws)
    return out


def group_runs(per_rank: Sequence[Host]) -> list[int]:
    """Each stage's tensor group size, in rank order: consecutive ranks whose hosts carry one group= name form a group
    (a rank without one is a stage of its own)."""
    sizes: list[int] = []
    for i, h in enumerate(per_rank):
        if i and h.group is not None and h.group == per_rank[i - 1].group:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


def option_args(settings: Mapping[str, object]) -> list[str]:
    """Options by their command-line names as the command line spells them: {"threads_batch": "2,1"} ->
    --threads-batch 2,1."""
    return [a for name, value in settings.items() for a in (f"--{name.replace('_', '-')}", str(value))]


def settings_args(hosts: Sequence[Host], np: int, given: Collection[str] = ()) -> list[str]:
    """host_settings as pipeinfer options (what `pipeinfer launch` adds to the command it runs)."""
    return option_args(host_settings(hosts, np, given))


def with_draft_last(hosts: Sequence[Host], np: int,
                    given: Collection[str] = ()) -> tuple[list[Host], dict[str, object]]:
    """(hosts in rank order, settings) for a hostfile with a draft host: the stage slots the first np - 1 ranks
    fill, then the draft host (the world's last rank is the draft's, ranks/draft_rank.py); settings draft_at rank and
    draft_threads (from its threads=) unless the user set them (`given`). Without a draft host: (hosts, {})."""
    draft = next((h for h in hosts if h.role == "draft"), None)
    if draft is None:
        return list(hosts), {}
    if np < 2:
        raise ValueError(f"np={np}: a hostfile with a draft host needs at least 2 ranks (a stage and the draft)")
    stages, left = [], np - 1
    for h in hosts:
        if h.role == "stage" and left > 0:
            stages.append(replace(h, slots=min(h.slots, left)))  # its settings and description kept
            left -= stages[-1].slots
    if left > 0:
        raise ValueError(f"np={np} exceeds the {np - 1 - left} stage slots + 1 draft slot in the hostfile")
    settings: dict[str, object] = {} if "draft_at" in given else {"draft_at": "rank"}
    if draft.threads and "draft_threads" not in given:
        settings["draft_threads"] = draft.threads
    return stages + [draft], settings


def _forwarded(env_forward: Iterable[str], environ: Mapping[str, str]) -> list[str]:
    names: list[str] = []
    for pat in env_forward:
        matches = sorted(fnmatch.filter(environ, pat)) if any(c in pat for c in "*?[") else (
            [pat] if pat in environ else [])
        names += [n for n in matches if n not in names]
    return names


def job_plan(hosts: Sequence[Host], np: int, pipeinfer_args: Sequence[str],
             accepts: Collection[str] | None = None) -> tuple[list[Host], list[str]]:
    """(the hosts in rank order, the pipeinfer arguments with the hostfile's settings added) of a job of np ranks: a
    host's lines together, the draft host last; its settings become options of the command where it takes them
    (``accepts``: the command's option names, as Config's fields; None: all) and the user did not set them."""
    args = list(pipeinfer_args)
    given = options_given(args)
    hosts, draft_settings = with_draft_last(group_hosts(hosts), np, given)
    settings = {**draft_settings, **host_settings(hosts, np - (hosts[-1].role == "draft"), given)}
    added = option_args({k: v for k, v in settings.items() if accepts is None or k in accepts})
    if added:  # options must come before a literal "--" in the user's args
        cut = args.index("--") if "--" in args else len(args)
        args[cut:cut] = added
    return hosts, args


def build_command(
    hosts: Sequence[Host],
    np: int,
    mpi: str,
    pipeinfer_args: Sequence[str],
    *,
    mpiexec: str = "mpiexec",
    python: str | None = None,
    env_forward: Iterable[str] = DEFAULT_ENV_FORWARD,
    extra: Sequence[str] = (),
    hostfile: str | os.PathLike | None = None,
    environ: Mapping[str, str] | None = None,
    accepts: Collection[str] | None = None,
) -> list[str]:
    """argv that runs ``python -m mpi4py -m pipeinfer ARGS`` on ``np`` ranks.

    The hostfile's settings become options of ARGS where its command takes them (``accepts``: the option names,
    as Config's fields, of that command; None: all).

    Writes the translated hostfile to ``hostfile`` (a new temporary file when
    None; the caller removes it). ``env_forward`` names (or glob patterns) of
    variables to pass on, kept only when set in ``environ`` (default
    ``os.environ``). ``extra`` goes right after the MPI's own options.
    """
    if mpi not in MPI_KINDS:
        raise ValueError(f"unknown MPI {mpi!r} (expected one of {MPI_KINDS})")
    hosts, args = job_plan(hosts, np, pipeinfer_args, accepts)
    if hostfile is None:
        fd, hostfile = tempfile.mkstemp(prefix="pipeinfer-hosts-", suffix=".txt")
        os.close(fd)
    hostfile = str(write_hostfile(hosts, mpi, hostfile))
    environ = os.environ if environ is None else environ
    python = python or container.rank_python(environ)
    names = container.env_forward(_forwarded(env_forward, environ), environ)
    if mpi == "mpich":
        cmd = [mpiexec, "-f", hostfile, "-n", str(np)]
        if names:
            cmd += ["-genvlist", ",".join(names)]
        # Hydra starts every rank in this folder and fails on a host that lacks it (Open MPI and srun fall back to
        # another): the ranks start in /, and each goes back to it where its host has it (enter_workdir)
        cmd += ["-wdir", "/", "-genv", WORKDIR_ENV, os.getcwd()]
    else:
        cmd = [mpiexec, "--hostfile", hostfile, "--np", str(np), "--bind-to", "none",
               "--map-by", "slot"]
        for n in names:
            cmd += ["-x", n]
    return cmd + list(extra) + [python, "-m", "mpi4py", "-m", "pipeinfer"] + args


# MPICH 5.0.2's Hydra leaves the last variable of its own environment out of what -genvlist forwards (measured: the
# same variable arrives when one more follows it). A supervised job's PIPEINFER_CONFIG is added last, and where a
# host's proxy does not inherit the launcher's environment (ssh, a container) the ranks started without it.
ENV_END = "PIPEINFER_ENV_END"


def launcher_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for the launcher's process, ending in ENV_END (a variable nobody reads): every variable before it
    reaches the ranks."""
    out = {k: v for k, v in env.items() if k != ENV_END}
    out[ENV_END] = "1"
    return out


WORKDIR_ENV = "PIPEINFER_WORKDIR"  # the folder `launch` ran in, for the ranks of an MPICH job (build_command)


def enter_workdir(environ=os.environ) -> None:
    """A rank of an MPICH job `launch` started in /: into the folder the launch ran in where this host has it (a
    relative path means the same as to the user there), else into the home folder."""
    workdir = environ.pop(WORKDIR_ENV, None)
    if workdir is None:
        return
    for where in (workdir, os.path.expanduser("~")):
        try:
            os.chdir(where)
            return
        except OSError:
            continue


# ---- the job as its launcher started it, read from the environment (before, or beside, MPI's own view)
# MPICH's Hydra (and Intel MPI, MVAPICH) set PMI_*, Open MPI's mpirun OMPI_COMM_WORLD_*, other PMIx launchers PMIX_*
LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


@dataclass(frozen=True)
class LauncherWorld:
    """What the launcher told this process: the job's size, this process's rank, and where the size came from."""
    size: int
    rank: int
    size_var: str


def launcher_world(environ) -> LauncherWorld | None:
    """The job as the launcher (mpiexec, mpirun) describes it in `environ`; None when no launcher started us."""
    size_var = next((v for v in LAUNCHER_SIZE_VARS if str(environ.get(v, "")).strip().isdigit()), None)
    if size_var is None:
        return None
    rank = next((int(environ[v]) for v in LAUNCHER_RANK_VARS if str(environ.get(v, "")).strip().isdigit()), 0)
    return LauncherWorld(int(environ[size_var]), rank, size_var)


def mpi_library(version_text: str) -> tuple[str | None, str]:
    """(kind, short name) of an MPI library from MPI_Get_library_version's text: kind "openmpi", "mpich" (MPICH and
    its derivatives, which share its ABI and its Hydra launcher) or None; name like "Open MPI 4.1.4"."""
    text = version_text.replace("\x00", "").strip()
    first = text.splitlines()[0].strip() if text else "an unknown MPI"
    m = re.match(r"open\s*mpi\s+v?([\w.]+)", first, re.I)
    if m:
        return "openmpi", f"Open MPI {m.group(1).rstrip(',')}"
    m = re.match(r"(mpich|mvapich\d*)\s+version\s*:\s*([\w.]+)", first, re.I)
    if m:
        return "mpich", f"{m.group(1).upper()} {m.group(2)}"
    if re.search(r"mpich|mvapich|intel\(r\) mpi", text, re.I):
        return "mpich", first[:60]
    return None, first[:60]


def world_size_mismatch(world_size: int, library: str, environ) -> str | None:
    """One line when MPI's world differs from the job the launcher started (the launcher is of another MPI than
    the library mpi4py loaded: every process then runs alone, as a job of its own), else None."""
    launched = launcher_world(environ)
    if launched is None or launched.size == world_size:
        return None
    return (f"the launcher started {launched.size} processes ({launched.size_var}={launched.size}) but MPI sees "
            f"{world_size}: mpiexec/mpirun is not of the MPI that mpi4py loads ({library}); run the job with that "
            f"MPI's launcher (`pipeinfer launch` picks it), or make mpi4py load the launcher's MPI "
            f"(MPI4PY_MPIABI / MPI4PY_LIBMPI, see docs/cluster.md)")


def mpi_size() -> int:
    """The job's size as its launcher (mpiexec, mpirun) started it; 1 without one. No MPI call."""
    launched = launcher_world(os.environ)
    return launched.size if launched else 1


def mpi_rank() -> int:
    """This process's rank as its launcher numbered it; 0 without one. No MPI call."""
    launched = launcher_world(os.environ)
    return launched.rank if launched else 0


def signal_to_pass_on(mpi: str, signum: int, first: bool) -> int:
    """The signal the MPI's launcher gets when this process gets `signum`. The first asks the job to stop cleanly:
    MPICH's mpiexec forwards SIGINT and SIGTERM to every rank; Open MPI's mpirun answers them by killing the ranks
    (SIGTERM, then SIGKILL 1 s later) but forwards SIGUSR1 as it is, which the ranks take as a stop
    (cli/guard.StopSignals). A later one ends the job the MPI's own way. srun ("slurm") forwards SIGTERM to every
    task (a single SIGINT only makes it report the tasks' states)."""
    if mpi == "slurm":
        return signal.SIGTERM
    if mpi == "openmpi":
        return signal.SIGUSR1 if first else signal.SIGTERM
    return signum
