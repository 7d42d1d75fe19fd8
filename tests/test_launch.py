"""Hostfile parsing, which MPI and which launcher, mpiexec command generation, the world a rank checks at start-up
(no MPI job is started: launchers are small scripts that print a version, and one process runs as if a launcher had
started it; tests/test_openmpi.py runs the real thing)."""
from __future__ import annotations

import os
import signal
import sys

import pytest
from click.testing import CliRunner

from pipeinfer.cli.main import main
from pipeinfer.wire import launcher as launch
from pipeinfer.core.errors import UserError
from pipeinfer.wire.launcher import (Host, build_command, format_hostfile, mpi_from_version,
                              parse_hostfile, parse_hostfile_text, settings_args)

HOSTS = """\
# a test cluster

alpha:2   # pipeinfer: threads=4 threads_batch=8 weight=2
beta slots=1 # pipeinfer: threads=2 weight=1.0
gamma        # pipeinfer: threads=1
   # indented comment
"""
ENV = {"PATH": "/usr/bin", "PIPEINFER_CACHE": "/c", "UNRELATED": "x"}


@pytest.fixture(autouse=True)
def _mpi4py_loads_the_mpich_wheel(monkeypatch):
    # these tests expect the default set-up (a user's MPI4PY_MPIABI=openmpi would make mpi4py load Open MPI)
    for name in [k for k in os.environ if k.startswith("MPI4PY_")]:
        monkeypatch.delenv(name)
PY = "/venv/bin/python"
MOD = [PY, "-m", "mpi4py", "-m", "pipeinfer"]
WDIR = ["-wdir", "/", "-genv", "PIPEINFER_WORKDIR", os.getcwd()]  # MPICH's ranks start in /, then go back here


def test_parse_slot_forms():
    hosts = parse_hostfile_text("a\nb:3\nc slots=4\nd slots=2 max_slots=8\ne:1 # just a note\n")
    assert [(h.name, h.slots) for h in hosts] == [("a", 1), ("b", 3), ("c", 4), ("d", 2), ("e", 1)]
    assert all(h.threads is None and h.weight is None for h in hosts)


def test_parse_settings_comment():
    hosts = parse_hostfile_text(HOSTS)
    assert hosts == [
        Host("alpha", 2, threads=4, threads_batch=8, weight=2.0),
        Host("beta", 1, threads=2, threads_batch=None, weight=1.0),
        Host("gamma", 1, threads=1),
    ]


def test_parse_file(tmp_path):
    p = tmp_path / "hosts"
    p.write_text("10.0.0.1:2\nnode-2.example.org\n")
    assert parse_hostfile(p) == [Host("10.0.0.1", 2), Host("node-2.example.org", 1)]


@pytest.mark.parametrize("text, lineno, what", [
    ("a\nb:x\n", 2, "bad host"),
    ("a\nb:0\n", 2, "positive"),
    ("a slots=2 foo\n", 1, "unexpected"),
    ("a:2 slots=3\n", 1, "twice"),
    ("a\n\nb # pipeinfer: threads=two\n", 3, "integer"),
    ("a # pipeinfer: threads=0\n", 1, "positive"),
    ("a # pipeinfer: weight=-1\n", 1, "weight"),
    ("a # pipeinfer: colour=3\n", 1, "unknown"),
    ("a # pipeinfer: threads\n", 1, "key=value"),
    ("a\nb # pipeinfer: role=drafter\n", 2, "unknown role 'drafter'"),
])
def test_parse_bad_lines(text, lineno, what):
    with pytest.raises(ValueError, match=rf"<hostfile>:{lineno}: .*{what}"):
        parse_hostfile_text(text)


def test_parse_memory_setting():
    hosts = parse_hostfile_text("big:2 # pipeinfer: mem=64\nsmall # pipeinfer: mem=7.5\nother\n")
    assert [h.mem for h in hosts] == [64.0, 7.5, None]
    for bad in ("mem=lots", "mem=0", "mem=-1", "mem=inf"):
        with pytest.raises(ValueError, match=r"<hostfile>:1: mem"):
            parse_hostfile_text(f"a # pipeinfer: {bad}\n")


def test_parse_empty():
    with pytest.raises(ValueError, match="no hosts"):
        parse_hostfile_text("# nothing\n\n")


@pytest.mark.parametrize("text, expected", [
    ("HYDRA build details:\n    Version:    4.2.0\n", "mpich"),
    ("HYDRA build details:\n Version: 5.0.2\n Release Date: unreleased\n", "mpich"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.6\nHydra build details:\n", "mpich"),
    ("mpiexec (OpenRTE) 4.1.2\n\nReport bugs to http://www.open-mpi.org/community/help/\n",
     "openmpi"),
    ("mpiexec (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/\n",
     "openmpi"),
])
def test_mpi_from_version(text, expected):
    assert mpi_from_version(text) == expected


def test_mpi_from_version_unknown():
    with pytest.raises(ValueError):
        mpi_from_version("bash: mpiexec: command not found")


def test_detect_mpi_with_fake_binary(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (Open MPI) 5.0.3' >&2\n")
    fake.chmod(0o755)
    assert launch.detect_mpi(str(fake)) == "openmpi"
    with pytest.raises(RuntimeError):
        launch.detect_mpi(str(tmp_path / "missing"))


def test_format_hostfile():
    hosts = parse_hostfile_text(HOSTS)
    assert format_hostfile(hosts, "mpich") == "alpha:2\nbeta:1\ngamma:1\n"
    assert format_hostfile(hosts, "openmpi") == "alpha slots=2\nbeta slots=1\ngamma slots=1\n"


def test_build_command_mpich(tmp_path):
    hosts = parse_hostfile_text(HOSTS)
    hf = tmp_path / "h.txt"
    cmd = build_command(hosts, 4, "mpich", ["generate", "-m", "t.gguf"], python=PY,
                        hostfile=hf, environ=ENV)
    assert cmd == ["mpiexec", "-f", str(hf), "-n", "4", "-genvlist", "PATH,PIPEINFER_CACHE", *WDIR,
                   *MOD, "generate", "-m", "t.gguf",
                   "--threads", "4,4,2,1", "--threads-batch", "8,8,2,1",
                   "--layer-split", "0.333333,0.333333,0.166667,0.166667"]
    assert hf.read_text() == "alpha:2\nbeta:1\ngamma:1\n"


def test_build_command_openmpi_fewer_ranks(tmp_path):
    hosts = parse_hostfile_text(HOSTS)
    hf = tmp_path / "h.txt"
    cmd = build_command(hosts, 3, "openmpi", ["generate"], mpiexec="/opt/ompi/bin/mpirun",
                        python=PY, hostfile=hf, environ=ENV, extra=["--allow-run-as-root"])
    assert cmd == ["/opt/ompi/bin/mpirun", "--hostfile", str(hf), "--np", "3",
                   "--bind-to", "none", "--map-by", "slot", "-x", "PATH", "-x", "PIPEINFER_CACHE",
                   "--allow-run-as-root", *MOD, "generate",
                   "--threads", "4,4,2", "--threads-batch", "8,8,2", "--layer-split", "0.4,0.4,0.2"]
    assert hf.read_text() == "alpha slots=2\nbeta slots=1\ngamma slots=1\n"


def test_build_command_plain_hosts_adds_nothing(tmp_path):
    hosts = [Host("n0", 1), Host("n1", 3)]
    cmd = build_command(hosts, 4, "mpich", ["generate", "-p", "hi"], python=PY,
                        hostfile=tmp_path / "h", environ={}, env_forward=())
    assert cmd == ["mpiexec", "-f", str(tmp_path / "h"), "-n", "4", *WDIR, *MOD, "generate", "-p", "hi"]


def test_mpich_ranks_start_in_a_folder_every_host_has(tmp_path, monkeypatch):
    """Hydra starts every rank in the folder the launch runs in and fails on a host without it ("unable to change
    wdir"): the ranks start in /, and each goes back into that folder where its host has it, else into its home."""
    cmd = build_command([Host("n0", 2)], 2, "mpich", ["generate"], python=PY, hostfile=tmp_path / "h", environ={})
    assert cmd[cmd.index("-wdir"):cmd.index(PY)] == WDIR
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir("/")
    for workdir, lands in ((tmp_path, tmp_path), (tmp_path / "only-on-the-head", home)):
        environ = {launch.WORKDIR_ENV: str(workdir)}
        launch.enter_workdir(environ)
        assert os.getcwd() == str(lands) and environ == {}  # (and not passed on to what the rank starts)
    launch.enter_workdir({})  # not a rank of such a job: stays where it is
    assert os.getcwd() == str(home)


def test_user_options_win_and_go_before_double_dash(tmp_path):
    hosts = parse_hostfile_text(HOSTS)
    args = ["generate", "--threads=9,9,9,9", "--layer-split", "1,1,1,1", "--", "-prompt-"]
    cmd = build_command(hosts, 4, "mpich", args, python=PY, hostfile=tmp_path / "h", environ={})
    assert cmd[cmd.index(PY) + 5:] == ["generate", "--threads=9,9,9,9", "--layer-split", "1,1,1,1",
                                       "--threads-batch", "8,8,2,1", "--", "-prompt-"]


def test_settings_errors():
    hosts = [Host("a", 1, threads=4), Host("b", 1)]
    with pytest.raises(ValueError, match="not on b"):
        settings_args(hosts, 2)
    assert settings_args(hosts, 1) == ["--threads", "4"]  # b gets no rank
    with pytest.raises(ValueError, match="exceeds"):
        settings_args(hosts, 3)
    # weights alone: unset hosts count 1.0
    assert settings_args([Host("a", 1, weight=3), Host("b", 1)], 2) == ["--layer-split", "0.75,0.25"]


def test_launch_cmd_dry_run(tmp_path, monkeypatch):
    hf = tmp_path / "hosts"
    hf.write_text("x:2 # pipeinfer: threads=3\ny slots=1 # pipeinfer: threads=5\n")
    out = tmp_path / "translated"
    monkeypatch.setattr(launch, "detect_mpi", lambda mpiexec: "mpich")
    res = CliRunner().invoke(main, ["launch", 
        "--hostfile", str(hf), "--mpiexec", "mympiexec", "--write-hostfile", str(out),
        "--dry-run", "--", "generate", "--n-predict", "8"])
    assert res.exit_code == 0, res.output
    first = res.output.splitlines()[0]
    assert first.startswith(f"mympiexec -f {out} -n 3 ")
    assert first.endswith("-m mpi4py -m pipeinfer generate --n-predict 8 --threads 3,3,5")
    assert out.read_text() == "x:2\ny:1\n"


def test_launch_serve_is_the_supervised_server(tmp_path):
    """`launch -- serve` runs `serve --hostfile` without mpiexec (it survives a lost host); --mpi-arg options go
    to the supervisor's launcher through PIPEINFER_MPI_ARGS."""
    hf = tmp_path / "hosts"
    hf.write_text("x:2\ny\n")
    before = os.environ.get("PIPEINFER_MPI_ARGS")
    res = CliRunner().invoke(main, ["launch", "--hostfile", str(hf), "--np", "2", "--mpi-arg=-iface",
                                                 "--mpi-arg=eth1", "--dry-run", "--", "serve", "--port", "9000"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == (f"PIPEINFER_MPI_ARGS='-iface eth1' {sys.executable} -m pipeinfer serve "
                        f"--hostfile {hf} --np 2 --port 9000")
    # the dry run also shows the server's first job as it would start it: its launcher with --mpi-arg's options
    assert lines[1] == "# the pipeline's first job, as the server starts it:"
    assert " -n 2 " in lines[2] and " -iface eth1 " in lines[2] and lines[2].endswith("rank0.sock")
    assert lines[3:5] == ["# its hostfile:", "# x:2"]
    # then each rank's layers, threads and RAM, and the host's (the hostfile describes no mem=: not checked)
    assert [ln.split(":")[0] for ln in lines[5:]] == ["# rank 0 x", "# rank 1 x", "# host x"]
    assert os.environ.get("PIPEINFER_MPI_ARGS") == before   # the options went to the job's command, not this process


def test_supervised_placement_takes_the_hostfiles_settings(tmp_path):
    from pipeinfer.core.config import Config, DraftOptions
    from pipeinfer.supervisor.placement import DraftHost, placement
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 1000)
    hf = tmp_path / "hosts"
    hf.write_text("a:2 # pipeinfer: threads=4 weight=2 mem=8\nb # pipeinfer: threads=2 weight=1\n")
    setup = Config(str(model))
    where = placement(None, str(hf), setup)
    assert where.slots == ["a", "a", "b"]
    assert (where.config.stage.threads, where.config.stage.layer_split) == ("4,4,2", "0.4,0.4,0.2")
    assert (where.footprint.weights_bytes, where.footprint.declared_gib) == (1000, {"a": 8.0})
    user_threads = Config(str(model), set_by_user=frozenset({"threads"})).with_options(threads="1")
    user_threads = placement(2, str(hf), user_threads).config.stage
    assert (user_threads.threads, user_threads.layer_split) == ("1", "0.5,0.5")  # the user's option wins
    hf.write_text("a\nd # pipeinfer: role=draft threads=2\n")  # the draft host: the job's last rank
    with_draft = Config(str(model), draft=DraftOptions(model=str(model), drafter="model", at="thread"))
    where = placement(None, str(hf), with_draft)
    assert where.slots == ["a"] and where.draft == DraftHost("d", {"draft_at": "rank", "draft_threads": 2}, 1000)
    assert where.footprint.head_bytes == 0  # not beside rank 0 (until its host is lost)
    with pytest.raises(UserError, match="d has role=draft but this run has no draft model"):
        placement(None, str(hf), setup)


def test_the_options_the_user_set_are_carried_in_the_config(tmp_path):
    """config_from_options records which options the command line set (not their defaults), and the Config carries
    them to the ranks: what a hostfile's settings must not override."""
    import click
    from click.testing import CliRunner

    from pipeinfer.cli.options import config_from_options, pipeline_options
    from pipeinfer.core.config import Config
    from pipeinfer.core.sampling import SamplingParams
    from pipeinfer.wire.launcher import options_given
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 1000)
    seen = []

    @click.command()
    @pipeline_options
    def cmd(**kw):
        seen.append(config_from_options(kw, sampling=SamplingParams(seed=3)))
    argv = ["-m", str(model), "--mode", "iterative", "--threads", "2", "--draft-threads=1"]
    result = CliRunner().invoke(cmd, argv)
    assert result.exit_code == 0, result.output
    given = seen[0].set_by_user
    assert {"threads", "draft_threads", "model", "mode"} <= given and not given & {"threads_batch", "layer_split"}
    assert Config.from_json(seen[0].to_json()) == seen[0]
    assert options_given(argv + ["--", "--layer-split", "x"]) == frozenset({"threads", "draft_threads"})
    result = CliRunner().invoke(cmd, ["-m", str(model), "-c", "2048", "--cache-prompt", "off", "--micro-batch", "fixed",
                                      "--poll-us", "1000", "--fast-kernels", "-pr", "0.25", "--draft-head", "full"])
    assert result.exit_code == 0, result.output
    config = seen[1]    # each option in its section, as click gave it and OPTION_FIELDS converts it
    assert (config.stage.n_ctx, config.stage.cache_prompt, config.stage.kernels) == (2048, False, "fast")
    assert (config.speculation.adaptive_draft, config.speculation.p_recovery) == (False, 0.25)
    assert (config.wire.poll_s, config.draft.head_tokens, config.serving.sampling.seed) == (0.001, None, 3)
    assert (config.serving.parallel, config.speculation.draft_max, config.serving.batch_rows) == (1, None, None)


def test_every_option_of_a_pipeline_run_has_its_place_in_the_config():
    """Every option of generate and serve that the run's ranks read is a section's field by its click name
    (OPTION_FIELDS), but the Config's own (model, mode), what a command makes of others (--fast-kernels: --kernels
    fast; --temp, --top-k, --top-p, --seed: the sampling), and the front end's own."""
    from dataclasses import fields

    from pipeinfer.cli.main import main
    from pipeinfer.core.config import OPTION_FIELDS, SECTIONS
    for name, where in OPTION_FIELDS.items():
        assert where.field in {f.name for f in fields(SECTIONS[where.section])}, name
    generate, serve = ({p.name for p in main.commands[c].params} for c in ("generate", "serve"))
    front_end = {"model", "mode", "fast_kernels", "results", "np", "hostfile", "rejoin"}
    assert (generate & serve) - front_end <= set(OPTION_FIELDS)
    assert {"replay_ref", "replay_accuracy", "replay_runner_up"} <= set(OPTION_FIELDS) & generate


@pytest.mark.parametrize("args, given", [
    (["-t", "8"], {"threads"}), (["-t8"], {"threads"}), (["-tb", "8"], {"threads_batch"}),
    (["-tb8", "-t", "2"], {"threads", "threads_batch"}), (["--", "-t", "8"], set()),
])
def test_a_short_option_wins_over_the_hostfile_too(tmp_path, args, given):
    """`launch -- generate -t 8` keeps the user's threads: the hostfile's threads= are not appended after them (the
    last --threads would win)."""
    from pipeinfer.wire.launcher import options_given
    assert options_given(args) == frozenset(given)
    cmd = build_command(parse_hostfile_text(HOSTS), 4, "mpich", ["generate", "-t", "8"], python=PY,
                        hostfile=tmp_path / "h", environ={})
    assert cmd[cmd.index(PY) + 5:] == ["generate", "-t", "8", "--threads-batch", "8,8,2,1",
                                       "--layer-split", "0.333333,0.333333,0.166667,0.166667"]


def test_dry_run_leaves_no_temporary_hostfile(tmp_path, monkeypatch):
    hf = tmp_path / "hosts"
    hf.write_text("x:1\ny:1\n")
    monkeypatch.setattr(launch, "detect_mpi", lambda mpiexec: "mpich")
    monkeypatch.setattr(launch.tempfile, "tempdir", str(tmp_path))  # mkstemp writes here
    res = CliRunner().invoke(main, ["launch", "--hostfile", str(hf), "--mpiexec", "mympiexec",
                                                 "--dry-run", "--", "generate"])
    assert res.exit_code == 0, res.output
    assert "# hostfile" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosts"]


def test_launch_cmd_bad_hostfile(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("x:y\n")
    res = CliRunner().invoke(main, ["launch", "--hostfile", str(hf), "--mpi", "mpich",
                                                 "--dry-run", "--", "generate"])
    assert res.exit_code != 0
    assert ":1: bad host" in res.output


def test_netns_exec_drops_ssh_options(tmp_path):
    """launch/cluster/netns-exec with a fake `ip`: options dropped, command run via bash -c."""
    import os
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "launch" / "cluster" / "netns-exec"
    fake_ip = tmp_path / "ip"
    fake_ip.write_text('#!/bin/sh\nif [ "$1 $2" = "netns list" ]; then echo "h0 (id: 0)"; echo h1;'
                       ' exit 0; fi\nfor a in "$@"; do echo "[$a]"; done\n')
    fake_ip.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")

    def run(*args):
        return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                              env=env, timeout=30)

    res = run("-x", "-T", "-o", "BatchMode=yes", "-oStrict=no", "-p22", "-l", "root",
              "user@h1", "/bin/proxy", "--arg", "a b")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:-1] == ["[netns]", "[exec]", "[h1]", "[env]", "[PIPEINFER_HOST=h1]", "[bash]",
                                           "[-c]", "[/bin/proxy --arg a b]"]
    res = run("-x", "h7", "true")
    assert res.returncode == 255 and "no network namespace named 'h7'" in res.stderr


# ---------------------------------------------------------------- the draft host (role=draft)
DRAFT_HOSTS = """\
weak-laptop   # pipeinfer: role=draft threads=2
alpha:2       # pipeinfer: threads=4 weight=2
beta          # pipeinfer: threads=8 weight=1
"""


def test_draft_host_becomes_the_last_rank(tmp_path):
    hosts = parse_hostfile_text(DRAFT_HOSTS)
    assert hosts[0] == Host("weak-laptop", 1, threads=2, role="draft")
    hf = tmp_path / "h.txt"
    cmd = build_command(hosts, 4, "mpich", ["generate"], python=PY, hostfile=hf, environ={})
    assert hf.read_text() == "alpha:2\nbeta:1\nweak-laptop:1\n"  # the draft host last, wherever its line is
    assert cmd[cmd.index(PY) + 5:] == ["generate", "--draft-at", "rank", "--draft-threads", "2",
                                       "--threads", "4,4,8", "--layer-split", "0.4,0.4,0.2"]  # target ranks only


def test_draft_host_with_fewer_ranks_trims_the_stage_slots(tmp_path):
    hf = tmp_path / "h.txt"
    cmd = build_command(parse_hostfile_text(DRAFT_HOSTS), 2, "mpich", ["generate", "--draft-threads", "1"],
                        python=PY, hostfile=hf, environ={})
    assert hf.read_text() == "alpha:1\nweak-laptop:1\n"  # rank 0 on alpha, rank 1 (the draft) on weak-laptop
    assert cmd[cmd.index(PY) + 5:] == ["generate", "--draft-threads", "1", "--draft-at", "rank",
                                       "--threads", "4", "--layer-split", "1"]


@pytest.mark.parametrize("text, what", [
    ("a # pipeinfer: role=draft\nb # pipeinfer: role=draft\nc\n", "2 hosts have role=draft"),
    ("a:2 # pipeinfer: role=draft\nb\n", "has 2 slots"),
    ("a # pipeinfer: role=draft\n", "only a draft host"),
])
def test_bad_draft_hosts(text, what):
    with pytest.raises(ValueError, match=what):
        parse_hostfile_text(text)


def test_draft_host_needs_a_stage_rank(tmp_path):
    with pytest.raises(ValueError, match="at least 2 ranks"):
        build_command(parse_hostfile_text(DRAFT_HOSTS), 1, "mpich", ["generate"], python=PY, hostfile=tmp_path / "h")


# ---------------------------------------------------------------- a host named on several lines
REPEATED = """\
a:1     # pipeinfer: threads=1 weight=1
b       # pipeinfer: threads=2 weight=2
a:2     # pipeinfer: threads=3 weight=1
"""


@pytest.mark.parametrize("mpi, text", [("mpich", "a:3\nb:1\n"), ("openmpi", "a slots=3\nb slots=1\n")])
def test_a_host_on_several_lines_is_one_line_and_its_ranks_come_together(tmp_path, mpi, text):
    # Open MPI refuses a host listed twice; both MPIs then place a's three ranks first, and the per-rank
    # settings follow the ranks where they run
    hf = tmp_path / "h.txt"
    cmd = build_command(parse_hostfile_text(REPEATED), 4, mpi, ["generate"], python=PY, hostfile=hf, environ={})
    assert hf.read_text() == text
    assert cmd[cmd.index(PY) + 5:] == ["generate", "--threads", "1,3,3,2", "--layer-split", "0.2,0.2,0.2,0.4"]


def test_a_draft_host_that_also_runs_an_earlier_stage_is_refused_for_open_mpi(tmp_path):
    hosts = parse_hostfile_text("a:1\nb:1\na # pipeinfer: role=draft\n")  # ranks a, b, a (the draft, last)
    build_command(hosts, 3, "mpich", ["generate"], python=PY, hostfile=tmp_path / "h", environ={})
    assert (tmp_path / "h").read_text() == "a:1\nb:1\na:1\n"  # Hydra places line by line
    with pytest.raises(ValueError, match="host a would run ranks that are not consecutive"):
        build_command(hosts, 3, "openmpi", ["generate"], python=PY, hostfile=tmp_path / "h", environ={})


def test_mpi4py_settings_go_to_every_rank(tmp_path):
    env = {"MPI4PY_MPIABI": "openmpi", "MPI4PY_LIBMPI": "/opt/ompi/lib/libmpi.so.40", "OTHER": "x"}
    cmd = build_command([Host("a", 2)], 2, "openmpi", ["generate"], python=PY, hostfile=tmp_path / "h", environ=env)
    assert cmd[cmd.index("-x"):cmd.index(PY)] == ["-x", "MPI4PY_LIBMPI", "-x", "MPI4PY_MPIABI"]


# ---------------------------------------------------------------- which MPI: the library mpi4py loads, its launcher
@pytest.mark.parametrize("text, kind, name", [
    ("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25\n", "mpich", "MPICH 5.0.2"),
    ("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022\x00", "openmpi",
     "Open MPI 4.1.4"),
    ("Open MPI v5.0.3, package: Open MPI builder, ident: 5.0.3", "openmpi", "Open MPI 5.0.3"),
    ("MVAPICH2 Version     :\t2.3.7\n", "mpich", "MVAPICH2 2.3.7"),
    ("Intel(R) MPI Library 2021.6 for Linux* OS\n", "mpich", "Intel(R) MPI Library 2021.6 for Linux* OS"),
    ("Microsoft MPI 10.1\n", None, "Microsoft MPI 10.1"),
])
def test_mpi_library_from_its_version_text(text, kind, name):
    from pipeinfer.wire.launcher import mpi_library
    assert mpi_library(text) == (kind, name)


def test_mpi4py_says_which_library_it_loads():
    # the test environment's mpi4py and the mpich wheel beside it
    lib = launch.mpi4py_library(sys.executable)
    assert lib.kind == "mpich" and lib.name.startswith("MPICH ") and lib.path.endswith(".so.12"), lib
    with pytest.raises(RuntimeError, match="cannot ask mpi4py which MPI library it loads"):
        launch.mpi4py_library(sys.executable, dict(os.environ, MPI4PY_MPIABI="nosuchmpi"))


def fake_launcher(path, version: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return str(path)


OMPI_VERSION, HYDRA_VERSION = "mpirun (Open MPI) 4.1.4", "HYDRA build details:"


def test_the_launcher_is_the_one_of_the_library_mpi4py_loads(tmp_path):
    # an Open MPI installed in a prefix of its own, MPICH's mpiexec beside this Python and on PATH
    lib = launch.MpiLibrary("openmpi", "Open MPI 4.1.4", str(tmp_path / "ompi" / "lib" / "libmpi.so.40"))
    ompi = fake_launcher(tmp_path / "ompi" / "bin" / "mpirun", OMPI_VERSION)
    venv_py = str(tmp_path / "venv" / "bin" / "python")
    fake_launcher(tmp_path / "venv" / "bin" / "mpiexec", HYDRA_VERSION)
    fake_launcher(tmp_path / "venv" / "bin" / "mpirun", HYDRA_VERSION)  # the mpich wheel has an mpirun too
    assert launch.choose_launcher(lib, python=venv_py, path_env=str(tmp_path / "venv" / "bin")) == ompi
    mpich = launch.MpiLibrary("mpich", "MPICH 5.0.2", str(tmp_path / "venv" / "lib" / "libmpi.so.12"))
    assert launch.choose_launcher(mpich, python=venv_py, path_env="") == str(tmp_path / "venv" / "bin" / "mpiexec")


def test_a_launcher_of_another_mpi_is_refused_in_one_line(tmp_path):
    lib = launch.MpiLibrary("mpich", "MPICH 5.0.2", "/venv/lib/libmpi.so.12")
    ompi = fake_launcher(tmp_path / "mpirun", OMPI_VERSION)
    with pytest.raises(RuntimeError) as e:
        launch.choose_launcher(lib, ompi)
    assert str(e.value) == (f"{ompi} is Open MPI's launcher but mpi4py loads MPICH 5.0.2 (/venv/lib/libmpi.so.12): "
                            "every rank would run as a separate one-process job; give MPICH's mpiexec, or make "
                            "mpi4py load Open MPI (export MPI4PY_MPIABI=openmpi)")
    nowhere = launch.MpiLibrary("openmpi", "Open MPI 4.1.4", str(tmp_path / "none" / "lib" / "libmpi.so.40"))
    with pytest.raises(RuntimeError, match="mpi4py loads Open MPI 4.1.4 .* but no launcher of it was found"):
        launch.choose_launcher(nowhere, python=str(tmp_path / "none" / "python"), path_env="")


def test_launch_refuses_an_mpi_other_than_the_one_mpi4py_loads(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("x:1\n")
    res = CliRunner().invoke(main, ["launch", "--hostfile", str(hf), "--mpi", "openmpi", "--dry-run",
                                                 "--", "generate"])
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert "--mpi openmpi, but mpi4py loads MPICH" in res.output


@pytest.mark.parametrize("mpi, sig, first, passed", [
    ("mpich", signal.SIGINT, True, signal.SIGINT), ("mpich", signal.SIGTERM, True, signal.SIGTERM),
    ("mpich", signal.SIGINT, False, signal.SIGINT),
    ("openmpi", signal.SIGINT, True, signal.SIGUSR1), ("openmpi", signal.SIGTERM, True, signal.SIGUSR1),
    ("openmpi", signal.SIGINT, False, signal.SIGTERM),
])
def test_which_signal_the_mpi_launcher_gets(mpi, sig, first, passed):
    assert launch.signal_to_pass_on(mpi, sig, first) == passed


# ---------------------------------------------------------------- every rank checks the world it was started in
def test_the_launchers_world_from_the_environment():
    from pipeinfer.wire.launcher import LauncherWorld, launcher_world, world_size_mismatch
    assert launcher_world({}) is None
    assert launcher_world({"PMI_SIZE": "3", "PMI_RANK": "2"}) == LauncherWorld(3, 2, "PMI_SIZE")
    assert launcher_world({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}) == \
        LauncherWorld(2, 1, "OMPI_COMM_WORLD_SIZE")
    assert world_size_mismatch(2, "MPICH 5.0.2", {"PMI_SIZE": "2"}) is None
    assert world_size_mismatch(1, "MPICH 5.0.2", {}) is None
    msg = world_size_mismatch(1, "Open MPI 4.1.4", {"PMI_SIZE": "2", "PMI_RANK": "1"})
    assert msg.startswith("the launcher started 2 processes (PMI_SIZE=2) but MPI sees 1: mpiexec/mpirun is not of "
                          "the MPI that mpi4py loads (Open MPI 4.1.4)")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_process_alone_in_its_world_ends_with_one_line_from_rank_0(models, rank):
    # what every process of a job sees when its launcher is of another MPI than mpi4py's library: a world of one
    # while the launcher said 2 (here the launcher's variables are set by hand, MPI is the real mpich wheel's)
    from helpers import cli
    env = dict(os.environ, PMI_SIZE="2", PMI_RANK=str(rank))
    p = cli(["generate", "-m", str(models["q8"]), "-p", "hi", "-n", "4", "-q"], env=env, timeout=60)
    assert p.returncode == 1 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("pipeinfer: error")]
    if rank:
        assert lines == [], p.stderr  # the same error on every process: the launcher's rank 0 says it
        return
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("pipeinfer: error: the launcher started 2 processes (PMI_SIZE=2) but MPI sees 1: "
                               "mpiexec/mpirun is not of the MPI that mpi4py loads (MPICH "), lines[0]


DOCS_HOSTS = ("head # pipeinfer: threads=4 threads_batch=8 weight=0.5\nxeon:2 # pipeinfer: threads=16 weight=2\n"
              "laptop # pipeinfer: role=draft threads=2\n")


def test_launch_passes_only_the_options_the_command_takes(tmp_path, monkeypatch):
    """A hostfile's settings become options only of a command that has them: `profile` takes --threads and
    --layer-split, not --draft-at, --draft-threads or --threads-batch (it would stop at "No such option")."""
    hf = tmp_path / "hosts"
    hf.write_text(DOCS_HOSTS)
    monkeypatch.setattr(launch, "detect_mpi", lambda mpiexec: "mpich")
    res = CliRunner().invoke(main, ["launch", "--hostfile", str(hf), "--mpiexec", "mympiexec", "--dry-run", "--",
                                          "profile"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    args = next(line for line in lines if " -m pipeinfer " in line).split(" -m pipeinfer ")[1].split()
    assert args == ["profile", "--threads", "4,16,16", "--layer-split", "0.111111,0.444444,0.444444"]
    # and it runs on the stage hosts' 3 slots only: the draft host's would be a 4th stage rank without a fraction
    assert "[pipeinfer] launch: profile runs no draft rank: laptop (role=draft) is left out" in lines
    assert " -n 3 " in next(line for line in lines if " -m pipeinfer " in line)
    assert lines[lines.index(next(line for line in lines if line.startswith("# hostfile "))) + 1:] == ["head:1",
                                                                                                      "xeon:2"]


def test_launch_never_shows_an_api_key(tmp_path):
    """`launch -- serve --api-key KEY` prints the server's command with the key hidden (keys are never echoed)."""
    hf = tmp_path / "hosts"
    hf.write_text("x\n")
    res = CliRunner().invoke(main, ["launch", "--hostfile", str(hf), "--dry-run", "--", "serve", "--api-key",
                                    "s3cret", "--api-key=t0ken", "--port", "9000"])
    assert res.exit_code == 0, res.output
    assert "s3cret" not in res.output and "t0ken" not in res.output
    assert res.output.splitlines()[0].endswith("serve --hostfile " + str(hf) +
                                               " --api-key KEY --api-key=KEY --port 9000")


@pytest.mark.parametrize("command, why", [
    (["generate", "-p", "hi"], "generate: --draft-at rank (or a hostfile's role=draft host): the draft rank has no "
                               "draft model: give --draft SMALL.gguf"),
    (["serve"], "serve: --hostfile {hf}: laptop has role=draft but this run has no draft model: give --draft "
                "SMALL.gguf"),
    (["generate", "--bogus"], "generate: No such option '--bogus'"),
    (["frobnicate"], "launch runs a pipeinfer command (attach, doctor, generate, "),
    ([], "launch: which pipeinfer command to run?"),
])
def test_dry_run_refuses_what_would_not_run(tmp_path, monkeypatch, command, why):
    """`launch --dry-run` checks the command it would run as that command would (options, models, configuration,
    placement): a model with no known draft and a role=draft host is one line naming what to pass."""
    hf = tmp_path / "hosts"
    hf.write_text(DOCS_HOSTS)
    model = tmp_path / "llama3.gguf"   # not a model pipeinfer knows a draft for
    model.write_bytes(b"x" * 1000)
    monkeypatch.setattr(launch.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(launch, "detect_mpi", lambda mpiexec: "mpich")
    args = command + (["-m", str(model)] if command[:1] in (["generate"], ["serve"]) else [])
    res = CliRunner().invoke(main, ["launch", "--hostfile", str(hf), "--mpiexec", "mympiexec", "--dry-run", "--", *args])
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert why.format(hf=hf) in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosts", "llama3.gguf"]  # no translated hostfile left


def test_a_draft_host_leaves_the_stage_hosts_descriptions(tmp_path):
    """With a role=draft host, the stage hosts keep their mem= and cores= (the dry run checks and deals them)."""
    from pipeinfer.wire.launcher import job_plan, parse_hostfile, rank_hosts
    (tmp_path / "hosts").write_text("a # pipeinfer: mem=4 cores=8\nb # pipeinfer: mem=6 cores=4\n"
                                    "c # pipeinfer: role=draft mem=2 cores=2\n")
    ordered, _ = job_plan(parse_hostfile(str(tmp_path / "hosts")), 3, ["generate"])
    assert [(h.name, h.mem, h.cores) for h in rank_hosts(ordered, 3)] == [("a", 4, 8), ("b", 6, 4), ("c", 2, 2)]


def test_the_launchers_environment_ends_in_a_variable_nobody_reads():
    """Hydra 5.0.2 leaves the last variable of its environment out of -genvlist (tests/test_netns.py shows it on a
    supervised job): whatever the order given, every variable before ENV_END, once, and ENV_END last."""
    env = launch.launcher_env({launch.ENV_END: "x", "PIPEINFER_CONFIG": "{}", "PATH": "/b"})
    assert list(env) == ["PIPEINFER_CONFIG", "PATH", launch.ENV_END] and env["PIPEINFER_CONFIG"] == "{}"
