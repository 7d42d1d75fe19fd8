"""Weights travel (issue 38): start-up on the emulated cluster when only h0 has the model, side by side with the
model everywhere, a whole-file copy to every host, and llama.cpp RPC loading the same model over the same links.

Needs root (launch/cluster/netns-cluster.sh). Every host has its own disk view (NETNS_DISKS: a mount namespace per host with
its own stages/ and weights/ folders; NETNS_HIDE: the models folder hidden on every host but h0, or on none).
Start-up is the wall time of `pipeinfer generate -n 8 --mode iterative` on N hosts (the 8 tokens, about a second,
are in every row alike). Rows:

- everywhere-cold / everywhere-warm: the model on every host; each host writes its own stage file (cold), then finds
  it (warm: the baseline of the issue's bounds);
- travel-first: the model on h0 only, empty caches elsewhere (h0's own stage warm, its identity index fresh, so the
  content hash of the whole file is in it); travel-second: the same again (nothing moves);
- everywhere-warm, travel-first and rpc run --rounds times side by side, their order rotating from round to round
  (each first start after emptying the caches), and report medians: one start apiece is at the mercy of the noise;
- reform-everywhere: the job on h0, h1 with the model on both, each host writing its new range's stage file: the
  re-form's baseline (what a re-form costs when every host has the model);
- reform: the job re-formed on h0, h1 after h2 is lost (what the supervisor starts): h1 gets only the tensors of its
  new stage file that its old one lacks; checked against the bytes it lacked, worked out from the layers' names;
- copy-whole: the whole GGUF copied from h0 to every other host over TCP at once (a plain socket: no encryption,
  so quicker than scp);
- rpc, rpc-c-cold, rpc-c-warm: llama.cpp's llama-completion on h0 with ggml-rpc-server on the other hosts
  (launch/bench/bench_peers.py builds them), without and with its tensor cache (-c).

    python launch/bench/bench_weights.py [--hosts 3] [--rate 1gbit] [--out results/bench_weights.csv]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import CLUSTER, MPIEXEC, ROOT, write_csv  # noqa: E402
from quiet import elapsed, run_quietly, timed  # noqa: E402

BIN = Path(sys.executable).parent
DISKS = Path("/var/tmp/pipeinfer-bench-weights")
PROMPT = "Write a Python function that checks whether a number is prime."
SENT = re.compile(r"weights: sent rank (\d+) \((\S+)\) .*?\(([\d,]+) bytes\) in ([\d.]+) s")
HASHED = re.compile(r"identified .* in ([\d.]+) s")
LAID = re.compile(r"laid out in ([\d.]+) s")
KEPT = re.compile(r"; \S+ \S+ \(([\d,]+) bytes\) of the file it already held")
RPC_PORT = 50077


def netns(rate: str, *args: str, disks: Path | None = None) -> None:
    env = dict(os.environ, NETNS_RATE=rate, MPIEXEC=MPIEXEC, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    if disks:
        env["NETNS_DISKS"] = str(disks)
    p = subprocess.run(["bash", str(CLUSTER / "netns-cluster.sh"), *args], env=env, capture_output=True,
                       text=True)
    if p.returncode:
        raise SystemExit(f"netns-cluster.sh {' '.join(args)}: {p.stderr[-2000:]}")
    return p.stderr


def pipeinfer_job(n: int, model: str, disks: Path, hide: bool) -> tuple[float, str, str, float]:
    """(seconds, stdout, stderr, foreign CPU %) of one generate on hosts h0..h(n-1)."""
    hostfile = Path(tempfile.mkstemp(suffix=".hosts")[1])
    hostfile.write_text("".join(f"h{i}:1\n" for i in range(n)))
    env = dict(os.environ, NETNS_DISKS=str(disks), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    env["NETNS_HIDE"] = str(Path(model).parent) if hide else ""
    cmd = [MPIEXEC, "-iface", "brpi", "-f", str(hostfile), "-launcher", "ssh", "-launcher-exec",
           str(CLUSTER / "netns-exec"), "-genv", "UCX_TLS", "tcp", "-genv", "FI_PROVIDER", "tcp",
           "-n", str(n), str(BIN / "pipeinfer"), "generate", "-m", model, "-p", PROMPT, "-n", "8", "--mode",
           "iterative", "-t", "1"]
    try:
        proc, pct = run_quietly(timed(cmd), tries=1, env=env)  # once: a retry would not be a first start
    finally:
        hostfile.unlink()
    if proc.returncode:
        raise SystemExit(f"pipeinfer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return elapsed(proc), proc.stdout, proc.stderr, pct


def _held(d: Path) -> dict[str, tuple[int, int, bool]]:
    """A host's cached stage files: name -> (start, end, with_vocab)."""
    import json
    try:
        files = json.loads((d / "index.json").read_text())["files"]
    except OSError:
        return {}
    return {k: (e["range"][0], e["range"][1], e["with_vocab"]) for k, e in files.items() if e["range"][0] >= 0
            and e["range"] != [0, 0]}


def _lacked(model: str, held: list[tuple[int, int, bool]], new: tuple[int, int, bool]) -> int:
    """The bytes of the new stage file that are not tensors of the model some held stage file has: what must
    travel, worked out from the layers (names), independently of the recipe ranks/weights.py sends by."""
    from gguf import GGUFReader
    from pipeinfer.engine.stagefile import stage_layout
    r = GGUFReader(model, "r")
    base = r.data.ctypes.data

    def tensors(a, b, v):  # source tensors of the stage file [a, b): {name}
        out = set()
        for t in r.tensors:
            if t.name.startswith("blk."):
                if a <= int(t.name.split(".")[1]) < b:
                    out.add(t.name)
            elif v or t.name not in ("token_embd.weight", "output.weight"):
                out.add(t.name)
        return out
    have = set().union(*(tensors(*h) for h in held)) if held else set()
    size = {t.data.ctypes.data - base: (t.name, t.data.nbytes) for t in r.tensors}
    layout = stage_layout(model, *new)
    kept = sum(p.nbytes for p in layout.pieces if p.src_offset >= 0 and size[p.src_offset][0] in have)
    return layout.size - kept


def copy_whole(n: int, model: str, disks: Path) -> float:
    """Seconds to copy the whole file from h0 to h1..h(n-1) at once over TCP (each host writes its copy)."""
    recv = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); c,_=s.accept(); f=open(sys.argv[3],'wb')\n"
            "while True:\n b=c.recv(1<<20)\n if not b: break\n f.write(b)\n"
            "f.flush(); import os; os.fsync(f.fileno()); print('done', flush=True)")
    send = ("import socket,sys,os; s=socket.create_connection((sys.argv[1], int(sys.argv[2]))); f=open(sys.argv[3],'rb');"
            " s.sendfile(f); s.close()")
    receivers, senders = [], []
    for i in range(1, n):
        dst = disks / f"h{i}" / "copy.gguf"
        dst.parent.mkdir(parents=True, exist_ok=True)
        receivers.append(subprocess.Popen(["ip", "netns", "exec", f"h{i}", sys.executable, "-c", recv,
                                           f"10.77.0.{i + 1}", str(RPC_PORT + i), str(dst)], stdout=subprocess.PIPE))
    time.sleep(1.0)
    t0 = time.monotonic()
    for i in range(1, n):
        senders.append(subprocess.Popen(["ip", "netns", "exec", "h0", sys.executable, "-c", send,
                                         f"10.77.0.{i + 1}", str(RPC_PORT + i), model]))
    for p in senders + receivers:
        p.wait()
    dt = time.monotonic() - t0
    for i in range(1, n):
        (disks / f"h{i}" / "copy.gguf").unlink(missing_ok=True)
    return dt


def rpc_load(n: int, model: str, disks: Path, cache: bool) -> float:
    """Seconds of llama-completion -n 1 on h0 with ggml-rpc-server on h1..h(n-1) (its tensor cache with -c, kept in
    each host's folder)."""
    from bench_peers import llama_bin
    bins = llama_bin()
    servers = []
    for i in range(1, n):
        env = dict(os.environ, LLAMA_CACHE=str(disks / f"h{i}" / "rpc-cache"))
        cmd = ["ip", "netns", "exec", f"h{i}", str(bins / "ggml-rpc-server"), "-H", f"10.77.0.{i + 1}", "-p",
               str(RPC_PORT), "-t", "1"] + (["-c"] if cache else [])
        servers.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.5)
    try:
        rpc = ",".join(f"10.77.0.{i + 1}:{RPC_PORT}" for i in range(1, n))
        cmd = ["ip", "netns", "exec", "h0", str(bins / "llama-completion"), "-m", model, "-p", PROMPT, "-n", "8",
               "-t", "1", "-tb", "1", "-c", "4096", "-fa", "on", "--temp", "0", "-no-cnv", "--no-display-prompt",
               "--rpc", rpc, "-ngl", "99"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        dt = time.monotonic() - t0
        if proc.returncode:
            raise SystemExit(f"llama-completion failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return dt
    finally:
        for s in servers:
            s.terminate()
            s.wait(timeout=30)


ROTATION = ("everywhere-warm", "travel-first", "rpc")


def side_by_side(a, model: str, every: Path, travel: Path, text_every: str) -> tuple[dict, list[str]]:
    """--rounds rounds of the baseline, a first start and llama.cpp RPC's load (without -c), in an order that
    rotates from round to round: {name: [seconds]} and each first start's stderr. Before each first start the
    receiving hosts' weights caches and h0's identity index are emptied, so every round is a first start."""
    times: dict[str, list[float]] = {name: [] for name in ROTATION}
    errs = []
    for i in range(a.rounds):
        for name in ROTATION[i % 3:] + ROTATION[:i % 3]:
            if name == "everywhere-warm":
                t, text, _, _ = pipeinfer_job(a.hosts, model, every, hide=False)
            elif name == "travel-first":
                for h in range(a.hosts):
                    shutil.rmtree(travel / f"h{h}" / "weights", ignore_errors=True)
                t, text, err, _ = pipeinfer_job(a.hosts, model, travel, hide=True)
                errs.append(err)
            elif a.no_rpc:
                continue
            else:
                t, text = rpc_load(a.hosts, model, travel, cache=False), text_every
            if text != text_every:
                raise SystemExit(f"{name}: another text than the model everywhere's first start")
            times[name].append(t)
            print(f"  round {i + 1}: {name:16s} {t:6.2f} s", flush=True)
    return times, errs


def _rounds(values: list[float]) -> str:
    return f"median of {len(values)} rounds ({', '.join(f'{v:.2f}' for v in values)})"


def main() -> None:
    from pipeinfer.engine.models import resolve_model
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_weights.csv"))
    ap.add_argument("--no-rpc", action="store_true", help="leave llama.cpp RPC out")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the baseline, a first start and RPC, side by "
                    "side (a single start is at the mercy of the machine's noise)")
    a = ap.parse_args()
    model = str(resolve_model(a.model))
    size = os.path.getsize(model)
    rate_bps = _bits(a.rate)
    shutil.rmtree(DISKS, ignore_errors=True)
    every, travel = DISKS / "everywhere", DISKS / "travel"
    rows = []

    def row(name, seconds, note="", **more):
        rows.append(dict(run=name, hosts=more.pop("hosts", a.hosts), seconds=round(seconds, 2), note=note, **more))
        print(f"{name:16s} {seconds:7.2f} s  {note}", flush=True)

    print(netns(a.rate, "up", str(a.hosts)).strip().splitlines()[-1], flush=True)
    try:
        t, text_every, err, pct = pipeinfer_job(a.hosts, model, every, hide=False)
        row("everywhere-cold", t, "each host writes its own stage file (and measures its exact batch limit)",
            foreign_cpu_pct=round(pct))
        shutil.copytree(every / "h0" / "stages", travel / "h0" / "stages")  # h0's own stage as warm as above
        times, errs = side_by_side(a, model, every, travel, text_every)
        t_every = statistics.median(times["everywhere-warm"])
        row("everywhere-warm", t_every, f"stage files found (the baseline); {_rounds(times['everywhere-warm'])}")
        err = errs[-1]  # the last first start's lines (every round moves the same bytes)
        t = statistics.median(times["travel-first"])
        sent = [(int(r), h, int(b.replace(",", "")), float(s)) for r, h, b, s in SENT.findall(err)]
        hashed = float(HASHED.search(err).group(1)) if HASHED.search(err) else 0.0
        laid = float(LAID.search(err).group(1)) if LAID.search(err) else 0.0
        largest = max(b for _, _, b, _ in sent)
        total = sum(b for _, _, b, _ in sent)
        bound = 1.3 * largest * 8 / rate_bps + t_every
        bound_link = 1.3 * total * 8 / rate_bps + t_every  # h0's one link carries every byte
        row("travel-first", t, f"sent {', '.join(f'{h} {b / 1e6:.1f} MB in {s:.1f} s' for _, h, b, s in sent)}; "
            f"hash of the model {hashed:.1f} s; layouts {laid:.1f} s; same text: True; "
            f"{_rounds(times['travel-first'])}",
            bytes_sent=total, largest_share=largest, hash_s=hashed, layout_s=laid,
            send_s=round(sum(x for _, _, _, x in sent), 2), same_text=True,
            bound_largest_share_s=round(bound, 2), bound_all_bytes_s=round(bound_link, 2))
        if times.get("rpc"):
            t_rpc = statistics.median(times["rpc"])
            row("rpc", t_rpc, f"llama-completion -n 8, rpc-server x {a.hosts - 1}; {_rounds(times['rpc'])}; "
                f"travel-first / rpc = {t / t_rpc:.2f}")
        t, text, err, pct = pipeinfer_job(a.hosts, model, travel, hide=True)
        row("travel-second", t, f"sent {len(SENT.findall(err))} files; x{t / t_every:.2f} the baseline; same text: "
            f"{text == text_every}", bytes_sent=sum(int(b.replace(',', '')) for _, _, b, _ in SENT.findall(err)),
            same_text=text == text_every, foreign_cpu_pct=round(pct))
        if a.hosts >= 3:
            n = a.hosts - 1
            t_base, _, _, pct = pipeinfer_job(n, model, every, hide=False)
            row("reform-everywhere", t_base, f"on {n} hosts with the model on every host: each writes the stage file of "
                "its new range and measures its exact batch limit, as after a lost host today (the re-form's baseline)",
                hosts=n, foreign_cpu_pct=round(pct))
            before = _held(travel / "h1" / "weights")
            t, text, err, pct = pipeinfer_job(n, model, travel, hide=True)
            sent = [(int(r), h, int(b.replace(",", "")), float(s)) for r, h, b, s in SENT.findall(err)]
            kept = sum(int(k.replace(",", "")) for k in KEPT.findall(err))
            after = _held(travel / "h1" / "weights")
            new = [v for k, v in after.items() if k not in before]
            lacked = _lacked(model, list(before.values()), new[0]) if len(new) == 1 else None
            moved = sum(b for _, _, b, _ in sent)
            bound = t_base + moved * 8 / rate_bps
            row("reform", t, f"on {n} hosts after h{a.hosts - 1} is lost: h1 held layers "
                f"{', '.join(f'{x[0]}-{x[1] - 1}' for x in before.values())}, needs {new[0][0]}-{new[0][1] - 1}"
                f"{' with the vocabulary' if new and new[0][2] else ''}; sent "
                f"{', '.join(f'{h} {b / 1e6:.1f} MB' for _, h, b, _ in sent) or 'nothing'}, kept {kept / 1e6:.1f} MB "
                f"it held; the bytes it lacked: {lacked} (moved == lacked: {moved == lacked}); same text: "
                f"{text == text_every}; baseline + moved at link speed = {bound:.1f} s",
                hosts=n, bytes_sent=moved, bytes_kept=kept, bytes_lacked=lacked, same_text=text == text_every,
                bound_reform_s=round(bound, 2), foreign_cpu_pct=round(pct))
        t = copy_whole(a.hosts, model, travel)
        row("copy-whole", t, f"{size / 1e6:.1f} MB to each of {a.hosts - 1} hosts at once over TCP; "
            f"size x hosts / link = {size * (a.hosts - 1) * 8 / rate_bps:.1f} s", bytes_sent=size * (a.hosts - 1))
        if not a.no_rpc:
            row("rpc-c-cold", rpc_load(a.hosts, model, travel, cache=True), "rpc-server -c, empty cache")
            row("rpc-c-warm", rpc_load(a.hosts, model, travel, cache=True), "rpc-server -c, cache filled")
    finally:
        netns(a.rate, "down", str(a.hosts))
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    write_csv(a.out, rows, keys)
    print(f"wrote {a.out}")


def _bits(rate: str) -> float:
    m = re.fullmatch(r"(\d+)([kmg]?)bit", rate.lower())
    return int(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


if __name__ == "__main__":
    main()
