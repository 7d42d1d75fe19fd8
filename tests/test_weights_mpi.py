"""Weights travel under mpiexec: a rank whose "host" lacks the model gets its stage file from rank 0 (ranks/weights.py).

One machine plays several hosts: each rank has its own cache (PIPEINFER_CACHE) and its own view of the file system
for the model (PIPEINFER_HOST_ROOT: rank 0's path looked up under that folder), given per rank with MPICH's
`-n 1 -env NAME VALUE CMD : ...`. The emulated cluster (launch/cluster/netns-cluster.sh) does the same with a mount
namespace per host."""
import json
import os
import signal
import time
from pathlib import Path

import pytest

from helpers import host_envs, kill_tagged, new_tag, rank_pids, run_on_hosts, tagged_env, wait_until
from synth import make_llama_gguf

pytestmark = pytest.mark.mpi

GEN = ["generate", "-p", "hi", "-n", "8", "--mode", "iterative", "-t", "1"]


def _cached(tmp: Path, r: int) -> list[str]:
    d = tmp / f"cache{r}" / "weights"
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".") and p.name != "index.json") \
        if d.exists() else []


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama_gguf(tmp_path_factory.mktemp("wmodel") / "m.gguf", n_layer=6, qtype="q8_0")


@pytest.fixture(scope="module")
def reference(model):
    p = run_on_hosts(GEN + ["-m", str(model)], [{}, {}, {}])
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_a_host_without_the_file_gets_it_and_the_next_start_moves_nothing(tmp_path, model, reference):
    from pipeinfer.core import stagecache
    from pipeinfer.ranks.handshake import model_fingerprint
    hosts = host_envs(tmp_path, 3)
    p = run_on_hosts(GEN + ["-m", str(model)], hosts)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == reference
    assert "weights: sent rank 1" in p.stderr and "weights: sent rank 2" in p.stderr
    assert len(_cached(tmp_path, 1)) == 1 and _cached(tmp_path, 1)[0].endswith(".novocab.s3.gguf")
    assert len(_cached(tmp_path, 2)) == 1 and ".novocab" not in _cached(tmp_path, 2)[0]
    assert _cached(tmp_path, 0) == []  # rank 0's host has the model: it keeps nothing in the weights cache
    # rank 0 hashed the model while the first file travelled; each host learnt the name to cache its file under
    assert "while the first file travelled" in p.stderr
    ident, fp = stagecache.file_digest(model), model_fingerprint(model)
    for r in (1, 2):
        (entry,) = stagecache.read_index(tmp_path / f"cache{r}" / "weights")["files"].values()
        assert entry["model"] == ident and entry["source_fp"] == fp and _cached(tmp_path, r)[0].startswith(ident[:32])
    again = run_on_hosts(GEN + ["-m", str(model)], hosts)
    assert again.returncode == 0 and again.stdout == reference
    assert "weights: sent" not in again.stderr and "identified" not in again.stderr  # the index knew the model
    # rank 0 with an empty index: the hosts may hold the model's files (by its fingerprint), so rank 0 hashes the
    # model before they look, and nothing travels
    hosts[0]["PIPEINFER_CACHE"] = str(tmp_path / "cache0b")
    fresh0 = run_on_hosts(GEN + ["-m", str(model)], hosts)
    assert fresh0.returncode == 0 and fresh0.stdout == reference, fresh0.stderr[-3000:]
    assert "weights: sent" not in fresh0.stderr and "before the hosts looked in their caches" in fresh0.stderr
    # -q: nothing said of the transfer (fresh caches on rank 2); rank 2 takes its exact batch limit from what rank 0's
    # host saw it measure (its stage's kernel key), not from a probe
    hosts[2].update(PIPEINFER_CACHE=str(tmp_path / "cache2b"), PIPEINFER_STAGE_CACHE=str(tmp_path / "stages2b"))
    quiet = run_on_hosts(GEN + ["-q", "-m", str(model)], hosts)
    assert quiet.returncode == 0 and quiet.stdout == reference and "weights:" not in quiet.stderr
    assert (tmp_path / "cache2b" / "weights" / _cached(tmp_path, 2)[0]).exists()
    (limit,) = [json.loads(p.read_text()) for p in (tmp_path / "stages2b").glob("*.exact.*.json")]
    assert limit["how"] == "taken from a stage with the same kernel key", limit


def test_a_re_formed_pipeline_moves_only_the_layers_a_host_lacks(tmp_path, model, reference):
    import re
    from pipeinfer.core import stagecache
    hosts = host_envs(tmp_path, 3)
    p = run_on_hosts(GEN + ["-m", str(model)], hosts)
    assert p.returncode == 0 and p.stdout == reference, p.stderr[-3000:]
    held = _cached(tmp_path, 1)
    # what the supervisor starts when host 2 is lost: the same hosts 0 and 1, one stage fewer; small chunks, so that
    # some travel whole, some in part and some not at all
    for h in hosts[:2]:
        h["PIPEINFER_WEIGHTS_CHUNK"] = "16384"
    p = run_on_hosts(GEN + ["-m", str(model)], hosts[:2])
    assert p.returncode == 0 and p.stdout == reference, p.stderr[-3000:]
    got = re.search(r"weights: sent rank 1 \(\S+\) .*?\(([\d,]+) bytes\) .*?; .*?\(([\d,]+) bytes\) of the file it "
                    r"already held", p.stderr)
    assert got, p.stderr[-3000:]
    sent, kept = (int(x.replace(",", "")) for x in got.groups())
    new = sorted(set(_cached(tmp_path, 1)) - set(held))
    assert len(new) == 1
    entry = stagecache.read_index(tmp_path / "cache1" / "weights")["files"]
    old_range, new_range = entry[held[0]]["range"], entry[new[0]]["range"]
    common = len(set(range(*old_range)) & set(range(*new_range)))
    assert common >= 1
    size = (tmp_path / "cache1" / "weights" / new[0]).stat().st_size
    assert sent + kept == size
    from pipeinfer.engine.stagefile import stage_layout

    def source_bytes(a, b):
        return sum(x.nbytes for x in stage_layout(model, a, b, False).pieces if x.src_offset >= 0)
    one_layer = source_bytes(0, 2) - source_bytes(0, 1)
    assert common * one_layer <= kept < (common + 1) * one_layer  # the layers in common (and the small norms)


def test_a_partial_cached_file_is_fetched_again(tmp_path, model, reference):
    hosts = host_envs(tmp_path, 3)
    assert run_on_hosts(GEN + ["-m", str(model)], hosts).returncode == 0
    f = tmp_path / "cache1" / "weights" / _cached(tmp_path, 1)[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # a copy cut short
    p = run_on_hosts(GEN + ["-m", str(model)], hosts)
    assert p.returncode == 0 and p.stdout == reference, p.stderr[-3000:]
    assert "weights: sent rank 1" in p.stderr and "weights: sent rank 2" not in p.stderr


def test_another_file_under_the_same_path_is_never_used(tmp_path, model, reference):
    hosts = host_envs(tmp_path, 3)
    theirs = tmp_path / "root1" / str(model).lstrip("/")
    theirs.parent.mkdir(parents=True)
    make_llama_gguf(theirs, n_layer=6, qtype="q8_0", seed=7)  # same name and shape, other weights
    assert theirs.read_bytes() != model.read_bytes()
    p = run_on_hosts(GEN + ["-m", str(model)], hosts)
    assert p.returncode == 0 and p.stdout == reference, p.stderr[-3000:]
    assert "weights: sent rank 1" in p.stderr  # rank 0's bytes, not the host's own file


def test_a_disk_too_small_is_one_line_and_every_rank_exits_non_zero(tmp_path, model):
    hosts = host_envs(tmp_path, 3)
    hosts[2]["PIPEINFER_WEIGHTS_FREE"] = "1000"
    p = run_on_hosts(GEN + ["-m", str(model)], hosts)
    assert p.returncode != 0
    lines = [l for l in p.stderr.splitlines() if "error" in l]
    assert lines and "has no room" in lines[0] and "rank 2 needs" in lines[0] and "1.0 kB free" in lines[0], p.stderr
    assert "weights: sent" not in p.stderr  # checked before any byte is sent
    assert _cached(tmp_path, 1) == [] and _cached(tmp_path, 2) == []


def open_files(pid: int) -> list[str]:
    """What the process's descriptors point to now; one closed while they are read is skipped (it is gone)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fds)
    except FileNotFoundError:  # the process has ended
        return []
    out = []
    for f in names:
        try:
            out.append(os.readlink(fds / f))
        except FileNotFoundError:
            continue
    return out


def test_a_sender_killed_mid_transfer_ends_the_job_naming_it_and_leaves_nothing(tmp_path, model):
    hosts = host_envs(tmp_path, 2)
    tag = new_tag()
    env = tagged_env(tag, PIPEINFER_WEIGHTS_THROTTLE_S="0.2", PIPEINFER_WEIGHTS_CHUNK="16384")
    proc = run_on_hosts(GEN + ["-m", str(model)], hosts, env=env, wait=False)
    try:
        def receiving():
            pids = rank_pids(tag)
            if 1 not in pids:
                return False
            return any(str(tmp_path / "cache1" / "weights") in target for target in open_files(pids[1]))
        wait_until(receiving, 60, "rank 1 receiving its stage file")
        time.sleep(0.5)
        os.kill(rank_pids(tag)[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        kill_tagged(tag)
    assert proc.returncode != 0
    assert "rank 0" in err and ("lost" in err or "unreachable" in err), err[-3000:]
    assert _cached(tmp_path, 1) == []  # nothing half-written, nothing indexed
    d = tmp_path / "cache1" / "weights"
    assert not list(d.glob("*.partial")) and not list(d.glob("*.gguf"))


def test_a_draft_rank_without_the_files_gets_the_draft_and_the_vocabulary(tmp_path, model, reference, models):
    hosts = host_envs(tmp_path, 3)
    hosts[1] = {"PIPEINFER_CACHE": str(tmp_path / "cache1")}  # the second stage's host has the model
    draft = models["draft90"]
    p = run_on_hosts(["generate", "-p", "hi", "-n", "8", "--mode", "pipeinfer", "-t", "1", "-m", str(model), "--draft",
              str(draft), "--draft-at", "rank"], hosts)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "weights: sent rank 2" in p.stderr
    names = _cached(tmp_path, 2)
    assert any(n.endswith(".whole.gguf") for n in names) and any(".vocab." in n for n in names), names
    assert _cached(tmp_path, 1) == []
