"""A user's first cluster, followed as docs/first-cluster.md (and the README's cluster commands) write it, on the
emulated 3-host cluster (launch/cluster/netns-cluster.sh: hosts h0, h1, h2 in network namespaces) with a target that is not
the demo model: a synthetic Llama GGUF and a smaller draft of its tokenizer (tests/synth.py).

The user types every command on the first host, h0 (`ip netns exec h0 ...`), in a folder that only h0 has, holding
the target, its draft, the hostfile (two stage hosts of unequal weight, a third with role=draft) and the key file;
ssh from h0 to the others is launch/cluster/netns-exec, first on PATH as `ssh`, which MPICH's Hydra runs as it would the
real one. The steps, in the page's order: `models drafts`, `plan --machines`, `doctor`, `launch --dry-run --
generate`, the command that dry run prints, `launch -- generate`, `launch --dry-run -- serve`, `launch -- serve
--api-key-file`, a colleague's OpenAI client at http://h0:8080/v1 with a key, and Ctrl-C; once as they are, once
with step 2's pinned ports (the servers listen on no other port). Every dry run exits 0 and
names a command that then runs; the answers through the cluster are the target's own (`pipeinfer generate` in one
process); the server refuses a request without the key in the API's error shape and stops cleanly, exit 0, nothing
left running on any host.

The emulation's own settings are environment variables: HYDRA_IFACE=eth0 (the page's `--mpi-arg=-iface
--mpi-arg=eth0`: the namespaces share one host name, which resolves to loopback), UCX_TLS/FI_PROVIDER=tcp (MPI
crosses the shaped links, not the one kernel's shared memory), NETNS_DISKS (each host its own caches) and NETNS_HIDE
(an empty file system over the user's folder on h1 and h2: the first start sends them their layers, and the folder
the user launches from is missing there, where MPICH's Hydra would start the ranks: wire/launcher.py build_command)."""
from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, kill_tagged, netns_unavailable, new_tag, tagged_env, tagged_pids, wait_until
from synth import PERTURB_FOR_AGREEMENT, make_llama_gguf

pytestmark = pytest.mark.mpi

ON_H0 = ["ip", "netns", "exec", "h0"]
PIPEINFER = [sys.executable, "-m", "pipeinfer"]  # `pipeinfer` as the docs write it
HOSTS = """\
# hosts: one host a line; the first is the host you run pipeinfer launch on (rank 0)
h0   # pipeinfer: threads=1 weight=2 cores=1 mem=4 mem_bw=10 disk=20 link=1000
h1   # pipeinfer: threads=1 weight=1 cores=1 mem=4 mem_bw=10 disk=20 link=1000
h2   # pipeinfer: role=draft threads=1 cores=1 mem=2 mem_bw=10 disk=20 link=1000
"""
TARGET, DRAFT = "models/llama-6l.gguf", "models/llama-6l-draft-q8_0.gguf"  # as the user names them, in the folder
PROMPT, N, PORT = "Hello", 32, 8080
# step 2, "if a firewall is on": the ports pinned, in the environment and on every launch and doctor
PINNED_ENV = {"MPIEXEC_PORT_RANGE": "50000:50099", "PIPEINFER_LIVENESS_PORT": "50100"}
PINNED_ARGS = ["--mpi-arg=-genv", "--mpi-arg=UCX_TCP_PORT_RANGE", "--mpi-arg=50200-50299"]
OPEN_PORTS = {*range(50000, 50101), *range(50200, 50300), PORT}  # what step 2 opens between the hosts


def _on_h0(args: list[str], env: dict, folder: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """`pipeinfer ARGS` typed on h0 in the user's folder: exit code, stdout and stderr as text."""
    p = subprocess.run(ON_H0 + PIPEINFER + args, capture_output=True, env=env, cwd=folder, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    p.stdout, p.stderr = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    return p


def _clean(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "pipeinfer: error" not in p.stderr, p.stderr[-3000:]


def _printed_job(stderr: str) -> tuple[list[str], str, str]:
    """What `launch --dry-run -- generate` prints: (the launcher's command, its hostfile's path, its text)."""
    lines = stderr.splitlines()
    command = next(line for line in lines if " -m mpi4py -m pipeinfer generate " in line)
    at = next(i for i, line in enumerate(lines) if line.startswith("# hostfile "))
    path = lines[at][len("# hostfile "):].rstrip(":")
    body = [line for line in lines[at + 1:] if not line.startswith("# ")]  # then each rank's and host's lines
    return shlex.split(command), path, "".join(line + "\n" for line in body)


def _get(path: str, key: str | None = None, body: dict | None = None) -> tuple[int, bytes]:
    """A colleague's request to the server on h0, over the emulated network."""
    conn = http.client.HTTPConnection("h0", PORT, timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        conn.request("POST" if body is not None else "GET", path, json.dumps(body) if body is not None else None,
                     headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _up() -> bool:
    try:
        return _get("/health")[0] == 200
    except OSError:
        return False


def _listening() -> dict[str, set[int]]:
    """The TCP ports each emulated host listens on beyond its loopback (only this test's processes run there)."""
    ports = {}
    for host in ("h0", "h1", "h2"):
        out = subprocess.run(["ip", "netns", "exec", host, "ss", "-Htln"], capture_output=True, text=True).stdout
        ports[host] = {int(local.rsplit(":", 1)[1]) for local in (line.split()[3] for line in out.splitlines())
                       if not local.startswith(("127.", "[::1]"))}
    return ports


@pytest.mark.parametrize("firewall", [False, True], ids=["no-firewall", "ports-pinned"])
def test_first_cluster_as_the_docs_write_it(tmp_path, firewall):
    """The page from step 1 to 9 (with step 2's pinned ports when `firewall`): every command runs as written."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    t0 = time.monotonic()
    folder = tmp_path / "h0-only" / "work"   # the user's folder, on h0 only (NETNS_HIDE=h0-only)
    (folder / "models").mkdir(parents=True)
    make_llama_gguf(folder / TARGET, n_layer=6)                     # 1.2 MB, f32
    make_llama_gguf(folder / DRAFT, n_layer=6, qtype="q8_0",        # 0.3 MB, the target's tokenizer, ~90% agreement
                    perturb=PERTURB_FOR_AGREEMENT[6][0.9])
    (folder / "hosts").write_text(HOSTS)
    key = secrets.token_hex(24)                                     # openssl rand -hex 24 > keys.txt
    (folder / "keys.txt").write_text(key + "\n")
    (folder / "keys.txt").chmod(0o600)                              # chmod 600 keys.txt
    (tmp_path / "bin").mkdir()
    ssh = tmp_path / "bin" / "ssh"
    ssh.write_text(f'#!/bin/sh\nexec {ROOT / "launch" / "cluster" / "netns-exec"} "$@"\n')
    ssh.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIPEINFER_", "NETNS_", "HYDRA_"))}
    tag = new_tag()
    env = tagged_env(tag, dict(  # (the tag: every process of this test, on every host, to find what is left)
        base, PATH=f"{tmp_path / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{base['PATH']}",
        PYTHONPATH=str(ROOT), PIPEINFER_CACHE=str(tmp_path / "cache"), HYDRA_IFACE="eth0", UCX_TLS="tcp",
        FI_PROVIDER="tcp", NETNS_DISKS=str(tmp_path / "disks"), NETNS_HIDE=str(folder.parent),
        **(PINNED_ENV if firewall else {})))
    mpi_args = PINNED_ARGS if firewall else []
    script = str(ROOT / "launch" / "cluster" / "netns-cluster.sh")
    up = subprocess.run(["bash", script, "up", "3"], capture_output=True, text=True, env=env, timeout=120)
    try:
        assert up.returncode == 0, up.stderr[-2000:]

        # the target's own answer: one process, no MPI (every answer through the cluster must be this text)
        alone = _on_h0(["generate", "-m", TARGET, "-p", PROMPT, "-n", str(N), "-t", "1"], env, folder)
        _clean(alone)
        answer = alone.stdout.removesuffix("\n")
        assert len(answer) > N, alone.stdout

        # step 4: the draft for this target (its tokenizer is no known family's: the translated one)
        drafts = _on_h0(["models", "drafts", TARGET], env, folder)
        _clean(drafts)
        assert drafts.stdout.startswith("--draft "), drafts.stdout

        # step 6: plan the hosts described in the hostfile: every share fits, and a command to run
        plan = _on_h0(["plan", "--machines", "hosts", "-m", TARGET], env, folder)
        _clean(plan)
        assert "fits: every host has the RAM and disk for its share" in plan.stdout, plan.stdout
        assert any(line.startswith("pipeinfer launch --hostfile hosts -- generate ") for line in plan.stdout.splitlines()), \
            plan.stdout

        # step 7: doctor: every host answers with this build; MPI crosses each link (not shared memory)
        doctor = _on_h0(["doctor", "--hostfile", "hosts", *mpi_args, "-m", TARGET], env, folder)
        _clean(doctor)
        assert "doctor: 3 host(s), no problem found" in doctor.stdout, doctor.stdout
        links = [float(m.group(1)) for m in re.finditer(r"^link \S+ -> h[12]: (\d+) Mbit/s", doctor.stdout, re.M)]
        assert len(links) == 2 and all(mbit < 2000 for mbit in links), doctor.stdout

        # step 8: the first start. The dry run exits 0 and prints the launcher's line and its hostfile ...
        generate = ["generate", "-m", TARGET, "--draft", DRAFT, "-p", PROMPT, "-n", str(N)]
        dry = _on_h0(["launch", "--hostfile", "hosts", *mpi_args, "--dry-run", "--", *generate], env, folder)
        _clean(dry)
        assert dry.stdout == "", dry.stdout
        printed, hostfile, hostfile_text = _printed_job(dry.stderr)
        assert hostfile_text == "h0:1\nh1:1\nh2:1\n" and not Path(hostfile).exists(), dry.stderr
        assert printed[printed.index("generate"):][-8:] == ["--draft-at", "rank", "--draft-threads", "1",
                                                            "--threads", "1,1", "--layer-split", "0.666667,0.333333"]
        # ... and that line runs (its hostfile written back: the dry run left no temporary file)
        Path(hostfile).write_text(hostfile_text)
        try:
            first = subprocess.run(ON_H0 + printed, capture_output=True, env=env, cwd=folder, timeout=180,
                                   stdin=subprocess.DEVNULL)
        finally:
            Path(hostfile).unlink(missing_ok=True)
        first.stdout, first.stderr = first.stdout.decode(errors="replace"), first.stderr.decode(errors="replace")
        _clean(first)
        assert first.stdout.removesuffix("\n") == answer, first.stderr[-2000:]
        # only h0 has the models: h1 receives its stage, h2 the draft (and the vocabulary); the split is 2:1
        assert "weights: sent rank 1 (h1)" in first.stderr and "weights: sent rank 2 (h2)" in first.stderr
        assert "2 rank(s): rank 0: layers [0, 4) on 1 thread, rank 1: layers [4, 6) on 1 thread" in first.stderr, \
            first.stderr[-2000:]
        assert f"drafter: {Path(DRAFT).name} (rank)" in first.stderr, first.stderr[-2000:]

        # the README's `launch -- generate`: the same answer, and nothing travels again
        again = _on_h0(["launch", "--hostfile", "hosts", *mpi_args, "--", *generate], env, folder)
        _clean(again)
        assert again.stdout.removesuffix("\n") == answer and "weights: sent" not in again.stderr

        # step 9: serve. The dry run: the server's command, its first job's launcher line and hostfile
        serve = ["serve", "-m", TARGET, "--draft", DRAFT, "--host", "0.0.0.0", "--port", str(PORT),
                 "--api-key-file", "keys.txt"]
        dry = _on_h0(["launch", "--hostfile", "hosts", *mpi_args, "--dry-run", "--", *serve], env, folder)
        _clean(dry)
        lines = dry.stdout.splitlines()
        assert lines[0].endswith(f"-m pipeinfer serve --hostfile hosts {shlex.join(serve[1:])}"), dry.stdout
        assert " -n 3 " in lines[2] and lines[-4:] == ["# its hostfile:", "# h0:1", "# h1:1", "# h2:1"], dry.stdout

        log = tmp_path / "serve.log"
        with open(log, "wb") as out:  # a terminal of its own: Ctrl-C goes to its process group
            server = subprocess.Popen(ON_H0 + PIPEINFER + ["launch", "--hostfile", "hosts", *mpi_args, "--", *serve],
                                      stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                      cwd=folder, start_new_session=True)

        def serving() -> bool:
            assert server.poll() is None, f"serve ended with {server.returncode}:\n{log.read_text()[-3000:]}"
            return _up()
        try:
            wait_until(serving, 180, lambda: log.read_text()[-3000:], every=0.2)
            text = log.read_text()
            assert (f"[pipeinfer] serving 'llama-6l' on http://0.0.0.0:{PORT}/v1 (mode pipeinfer, 2 rank(s) and the "
                    f"draft on h2 in a supervised job") in text and "API key required" in text, text
            assert key not in text and "warning" not in text.lower(), text
            health = json.loads(_get("/health")[1])  # /health needs no key
            assert health["status"] == "ok" and health["ranks"] == 2 and health["draft_host"] == "h2", health

            # a colleague, on another machine, with a key
            from openai import OpenAI
            client = OpenAI(base_url=f"http://h0:{PORT}/v1", api_key=key, max_retries=0, timeout=120)
            assert client.models.list().data[0].id == "llama-6l"  # the GGUF's file name without .gguf
            reply = client.chat.completions.create(model="llama-6l", max_tokens=N,
                                                   messages=[{"role": "user", "content": PROMPT}])
            assert reply.choices[0].message.content == answer, log.read_text()[-2000:]
            # and one without
            status, body = _get("/v1/chat/completions", None,
                                {"model": "llama-6l", "messages": [{"role": "user", "content": PROMPT}]})
            error = json.loads(body)["error"]
            assert status == 401 and error["code"] == "invalid_api_key" and set(error) == {
                "message", "type", "param", "code"}, body
            if firewall:  # every port the served cluster listens on beyond loopback is one step 2 opened
                listening = _listening()
                assert PORT in listening["h0"] and all(ports <= OPEN_PORTS for ports in listening.values()), listening
        finally:
            # Ctrl-C: the server finishes what is in progress and stops its job on every host
            os.killpg(server.pid, signal.SIGINT)
            try:
                code = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                code = server.wait()
        text = log.read_text(errors="replace")
        assert code == 0, text[-3000:]
        assert "[pipeinfer] stopping: the pipeline's job finishes the requests in progress" in text, text[-3000:]
        assert "Traceback" not in text and "pipeinfer: error" not in text, text[-3000:]
        wait_until(lambda: not tagged_pids(tag), 10, lambda: f"left running: {tagged_pids(tag)}")
    finally:
        kill_tagged(tag)
        subprocess.run(["bash", script, "down", "3"], capture_output=True, env=env, timeout=120)
    print(f"first cluster, from the target's own answer to Ctrl-C: {time.monotonic() - t0:.1f} s")


def test_the_command_plan_prints_runs(tmp_path):
    """docs/first-cluster.md step 6: `plan --machines hosts -m MODEL` prints the command to run; with the page's
    hostfile (a role=draft host) and a target no known draft pairs with, that command's dry run must exit 0."""
    (tmp_path / "models").mkdir()
    make_llama_gguf(tmp_path / TARGET, n_layer=6)
    make_llama_gguf(tmp_path / DRAFT, n_layer=6, qtype="q8_0", perturb=PERTURB_FOR_AGREEMENT[6][0.9])
    (tmp_path / "hosts").write_text(HOSTS)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for plan_args in (["-m", TARGET], ["-m", TARGET, "--draft", DRAFT]):
        plan = subprocess.run(PIPEINFER + ["plan", "--machines", "hosts", *plan_args], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=120)
        assert plan.returncode == 0, plan.stderr[-2000:]
        printed = shlex.split(next(line for line in plan.stdout.splitlines() if line.startswith("pipeinfer launch")))
        assert printed[:5] == ["pipeinfer", "launch", "--hostfile", "hosts", "--"], plan.stdout
        dry = subprocess.run(PIPEINFER + ["launch", "--hostfile", "hosts", "--dry-run", "--", *printed[5:]],
                             capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
        assert dry.returncode == 0, f"{shlex.join(printed)}\n{dry.stderr[-2000:]}"
