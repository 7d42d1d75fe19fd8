"""Failure behaviour (issue 13): every row of docs/failures.md's table (tests/faults.py; launch/bench/failures.py measures it).

Faults: a rank stopped (`kill -STOP`) or killed (`kill -9`) while a 3-rank PipeInfer generation streams:
one line naming the rank and its host, the job ends within --stall-timeout + 10 s, the text so far is on
stdout and --results has the row, marked failed. Bad input: one line, non-zero exit, no traceback, < 30 s.
Rows whose test lives elsewhere (tests/test_cli.py, tests/test_netns.py) name it in tests/faults.py's CASES.
"""
import signal
from pathlib import Path

import pytest

import faults as F

pytestmark = pytest.mark.mpi
HERE = [c for c in F.CASES if c.test == "tests/test_failures.py"]


@pytest.fixture(scope="module")
def fmodels(tmp_path_factory):
    return F.make_models(tmp_path_factory.mktemp("fmodels"))


def test_every_row_has_a_test():
    for c in F.CASES:
        path, _, name = c.test.partition("::")
        text = (Path(__file__).resolve().parent.parent / path).read_text()
        assert (f"def {name}(" in text) if name else c in HERE, c.name


@pytest.mark.parametrize("case", HERE, ids=[c.name for c in HERE])
def test_failure_row(case, fmodels, tmp_path):
    r = F.run_case(case, fmodels, tmp_path)
    ctx = f"{r['error']}\n{r['stderr_tail']}"
    codes = case.exit_code if isinstance(case.exit_code, tuple) else (case.exit_code,)
    assert r["exit_code"] in codes, ctx
    assert not r["traceback"], ctx
    if case.fault is None:
        assert r["n_error_lines"] == 1 and case.match in r["error"], ctx
        assert r["seconds"] < 30, ctx
        return
    assert r["from"] == "fault", "the fault was not injected: " + ctx
    if case.resumes:
        F.check_resumed(case, r)
        return
    sig, rank = case.fault
    assert r["seconds"] < F.STALL + 10, ctx
    assert r["stdout_bytes_at_fault"] > 0 and r["stdout_bytes"] >= r["stdout_bytes_at_fault"], ctx
    if rank == 0 and sig == signal.SIGKILL:
        # mpiexec's clean-up may take rank 1 before its line is out: the line is optional, never wrong
        assert r["n_error_lines"] <= 1 and case.match in r["error"], ctx
        return
    assert r["n_error_lines"] == 1 and case.match in r["error"], ctx
    assert ("went silent" if sig == signal.SIGSTOP else "was lost") in r["error"], ctx
    if case.results_status:
        assert (r["results_status"] or "").startswith(case.results_status), ctx
