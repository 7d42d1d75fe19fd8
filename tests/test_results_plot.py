"""Results CSV and bar charts."""
from __future__ import annotations

import csv
import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipeinfer.core.results import RESULT_COLUMNS, append_result, read_results


def _row(mode, draft, ranks, speed, **kw):
    row = dict(mode=mode, target_model="/models/dolphin-70b.Q3_K_M.gguf", draft_model=draft,
               ranks=ranks, prompt_name="code", n_prompt_tokens=128, n_generated=512,
               gen_tokens_per_s=speed, ttft_s=1.0 / speed, itl_mean_s=0.5 / speed,
               peak_rss_sum_mb=2048.0 * ranks, peak_rss_max_mb=2048.0, version="0.1.0")
    if draft:
        row["acceptance_rate"] = 0.7
    row.update(kw)
    return row


def test_columns_as_specified():
    assert RESULT_COLUMNS[:4] == ["timestamp", "mode", "target_model", "draft_model"]
    assert RESULT_COLUMNS[19] == "version" and RESULT_COLUMNS[20:] == ["kernels", "exact_batch_limit", "bytes_per_token",
                                                                     "simulated", "status", "draft_bytes_per_token"]
    assert len(set(RESULT_COLUMNS)) == 26


def test_append_writes_header_once(tmp_path):
    path = tmp_path / "sub" / "dir" / "results.csv"  # parent dirs are created
    append_result(path, {"mode": "iterative", "ranks": 3, "gen_tokens_per_s": 4.25,
                         "threads": [2, 2, 1]})
    append_result(path, {"mode": "pipeinfer", "ttft_s": 0.5, "acceptance_rate": None})
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == RESULT_COLUMNS
    assert len(lines) == 3 and all(len(line) == len(RESULT_COLUMNS) for line in lines)
    rows = read_results(path)
    assert rows[0]["mode"] == "iterative" and rows[0]["ranks"] == 3
    assert rows[0]["gen_tokens_per_s"] == 4.25 and rows[0]["threads"] == "2,2,1"
    assert rows[0]["timestamp"]  # filled in
    assert rows[1]["ttft_s"] == 0.5 and rows[1]["acceptance_rate"] is None
    assert rows[1]["ranks"] is None and rows[1]["draft_model"] is None


def test_append_to_empty_file_writes_header(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("")
    append_result(path, {"mode": "single"})
    assert path.read_text().splitlines()[0] == ",".join(RESULT_COLUMNS)


def test_unknown_key_rejected(tmp_path):
    path = tmp_path / "r.csv"
    with pytest.raises(ValueError, match="bogus"):
        append_result(path, {"mode": "single", "bogus": 1})
    assert not path.exists()


def test_an_older_file_is_upgraded_when_appended_to(tmp_path):
    path = tmp_path / "old.csv"
    old = RESULT_COLUMNS[:20]
    path.write_text(",".join(old) + "\n" + ",".join(["2026-01-01T00:00:00", "iterative"] + [""] * 18) + "\n")
    append_result(path, {"mode": "pipeinfer", "kernels": "repack", "exact_batch_limit": 3, "bytes_per_token": [19111, 36]})
    rows = read_results(path)
    assert [r["mode"] for r in rows] == ["iterative", "pipeinfer"]
    assert rows[0]["kernels"] is None and rows[1]["kernels"] == "repack" and rows[1]["exact_batch_limit"] == 3
    assert rows[1]["bytes_per_token"] == "19111,36"


def test_a_file_without_the_simulated_and_status_columns_gets_them(tmp_path):
    path = tmp_path / "old.csv"
    old = RESULT_COLUMNS[:23]  # written before issue 13: every row was a successful run
    path.write_text(",".join(old) + "\n" + ",".join(["2026-01-01T00:00:00", "iterative"] + [""] * 21) + "\n")
    append_result(path, {"mode": "pipeinfer", "status": "failed: rank 1 (host h1, pid 7) went silent"})
    rows = read_results(path)
    assert [r["status"] for r in rows] == [None, "failed: rank 1 (host h1, pid 7) went silent"]
    assert path.read_text().splitlines()[0].endswith(",bytes_per_token,simulated,status,draft_bytes_per_token")


def test_foreign_header_rejected(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="header"):
        append_result(path, {"mode": "single"})


def test_read_missing_file(tmp_path):
    assert read_results(tmp_path / "none.csv") == []


def _check_png(path):
    mpimg = pytest.importorskip("matplotlib.image")
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    # non-trivial: many distinct colours, not a blank canvas
    flat = img[..., :3].reshape(-1, 3)
    assert flat.std() > 0.05
    assert len({tuple(p) for p in flat[:: max(1, len(flat) // 5000)].round(2)}) > 5


def test_plot_results(tmp_path):
    from pipeinfer.cli.plot import plot_results
    csv_path = tmp_path / "results.csv"
    for ranks in (2, 4):
        append_result(csv_path, _row("iterative", None, ranks, 1.0))
        for draft, s in (("tinyllama-1.1b.Q4_K_M.gguf", 2.0), ("orca2-7b.Q4_K_M.gguf", 1.5)):
            append_result(csv_path, _row("speculative", draft, ranks, s))
            append_result(csv_path, _row("pipeinfer", draft, ranks, s * 1.5))
            append_result(csv_path, _row("pipeinfer", draft, ranks, s * 1.7, prompt_name="story"))
    paths = plot_results(csv_path, tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == ["acceptance.png", "gen_speed.png", "itl.png", "speed_per_memory.png",
                     "ttft.png"]
    for p in paths:
        assert p.stat().st_size > 1000
        _check_png(p)


def test_plot_groups_share_draftless_baseline():
    from pipeinfer.cli.plot import _groups
    rows = [dict(target_model="t.gguf", draft_model=None, ranks=2, mode="iterative"),
            dict(target_model="t.gguf", draft_model="d1.gguf", ranks=2, mode="pipeinfer"),
            dict(target_model="t.gguf", draft_model="d2.gguf", ranks=2, mode="pipeinfer"),
            dict(target_model="u.gguf", draft_model=None, ranks=3, mode="iterative")]
    g = _groups(rows)
    assert list(g) == [("t", "d1", 2), ("t", "d2", 2), ("u", "", 3)]
    assert [r["mode"] for r in g[("t", "d1", 2)]] == ["pipeinfer", "iterative"]


def test_plot_cli_and_empty(tmp_path):
    from pipeinfer.cli.plot import plot_cmd
    csv_path = tmp_path / "r.csv"
    append_result(csv_path, {"mode": "single", "target_model": "t.gguf", "ranks": 1})
    res = CliRunner().invoke(plot_cmd, [str(csv_path), "-o", str(tmp_path / "png")])
    assert res.exit_code == 0, res.output
    assert len(res.output.split()) == 5
    for name in ("gen_speed.png", "acceptance.png"):
        _check_png(tmp_path / "png" / name)


def test_the_command_line_loads_matplotlib_only_to_plot():
    # every rank of every job loads the command line: pyplot there cost each process 0.3 s of CPU at start-up
    code = ("import sys, pipeinfer.cli.main, pipeinfer.ranks.startup; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib loaded'; "
            "from pipeinfer.cli.plot import _pyplot; _pyplot(); assert 'matplotlib.pyplot' in sys.modules")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
