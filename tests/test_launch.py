"""Hostfile parsing and mpiexec command generation (no MPI job is started)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeinfer.cli import launch
from pipeinfer.cli.launch import (Host, build_command, format_hostfile, mpi_from_version,
                              parse_hostfile, parse_hostfile_text, settings_args)

HOSTS = """\
# a test cluster

alpha:2   # pipeinfer: threads=4 threads_batch=8 weight=2
beta slots=1 # pipeinfer: threads=2 weight=1.0
gamma        # pipeinfer: threads=1
   # indented comment
"""
ENV = {"PATH": "/usr/bin", "PIPEINFER_CACHE": "/c", "UNRELATED": "x"}
PY = "/venv/bin/python"
MOD = [PY, "-m", "mpi4py", "-m", "pipeinfer"]


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
    ("a # pipeinfer: cores=3\n", 1, "unknown"),
    ("a # pipeinfer: threads\n", 1, "key=value"),
    ("a\nb # pipeinfer: role=drafter\n", 2, "unknown role 'drafter'"),
])
def test_parse_bad_lines(text, lineno, what):
    with pytest.raises(ValueError, match=rf"<hostfile>:{lineno}: .*{what}"):
        parse_hostfile_text(text)


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
    assert cmd == ["mpiexec", "-f", str(hf), "-n", "4", "-genvlist", "PATH,PIPEINFER_CACHE",
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
    assert cmd == ["mpiexec", "-f", str(tmp_path / "h"), "-n", "4", *MOD, "generate", "-p", "hi"]


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
    res = CliRunner().invoke(launch.launch_cmd, [
        "--hostfile", str(hf), "--mpiexec", "mympiexec", "--write-hostfile", str(out),
        "--dry-run", "--", "generate", "--n-predict", "8"])
    assert res.exit_code == 0, res.output
    first = res.output.splitlines()[0]
    assert first.startswith(f"mympiexec -f {out} -n 3 ")
    assert first.endswith("-m mpi4py -m pipeinfer generate --n-predict 8 --threads 3,3,5")
    assert out.read_text() == "x:2\ny:1\n"


def test_dry_run_leaves_no_temporary_hostfile(tmp_path, monkeypatch):
    hf = tmp_path / "hosts"
    hf.write_text("x:1\ny:1\n")
    monkeypatch.setattr(launch, "detect_mpi", lambda mpiexec: "mpich")
    monkeypatch.setattr(launch.tempfile, "tempdir", str(tmp_path))  # mkstemp writes here
    res = CliRunner().invoke(launch.launch_cmd, ["--hostfile", str(hf), "--mpiexec", "mympiexec",
                                                 "--dry-run", "--", "generate"])
    assert res.exit_code == 0, res.output
    assert "# hostfile" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosts"]


def test_launch_cmd_bad_hostfile(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("x:y\n")
    res = CliRunner().invoke(launch.launch_cmd, ["--hostfile", str(hf), "--mpi", "mpich",
                                                 "--dry-run", "--", "generate"])
    assert res.exit_code != 0
    assert ":1: bad host" in res.output


def test_netns_exec_drops_ssh_options(tmp_path):
    """launch/netns-exec with a fake `ip`: options dropped, command run via bash -c."""
    import os
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "launch" / "netns-exec"
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
