"""The target's own multi-token-prediction head as the drafter (--drafter mtp): the payload, the head's keeping of
proposals, the refusals, the MTP context on a synthetic glm4moe with a nextn block, and every mode exact under
mpiexec on 2 and 3 ranks."""
import subprocess
import sys

import numpy as np
import pytest

from helpers import MPIEXEC, ROOT, mpirun
from pipeinfer.core.protocol import Flag, Header, Kind, ProtocolError, Tag, pack_mtp, payload_shapes, unpack_mtp
from pipeinfer.drafters.drafter import Cutoffs
from pipeinfer.drafters.mtpdraft import MtpDrafter

P = [1, 5, 9, 13, 22, 37, 41]
N = 32


@pytest.fixture(scope="module")
def glm(tmp_path_factory, models):
    """A synthetic glm4moe (q8_0: batches exact to 3 rows here) with one nextn block, and a llama without any."""
    from synth_arch import make_arch_gguf
    d = tmp_path_factory.mktemp("mtp")
    return {"mtp": str(make_arch_gguf(d / "glm4moe.gguf", "glm4moe", qtype="q8_0")), "plain": str(models["q8"])}


def transparent_glm4moe(path):
    """A synthetic glm4moe whose blocks add nothing to the residual stream (every attention and FFN output matrix
    zero) and whose nextn block reads only the token's embedding (eh_proj = [I | 0]): the target's next token depends
    only on the current one (the codebook's successor), and its MTP head, fed that next token, proposes the same
    successor for the position after: an MTP head that always agrees (synth_arch.make_arch_gguf, so changed)."""
    import synth_arch as sa
    v, r = sa.VARIANTS["glm4moe"], np.random.default_rng(0)
    tensors = {"token_embd.weight": r.standard_normal((sa.V, sa.E)), v.out_norm: np.ones(sa.E)}
    for il in range(v.n_layer + v.n_nextn):
        tensors |= {f"blk.{il}.{k}": a for k, a in v.layer(r, il, v.n_layer).items()}
    for name in tensors:
        if name.endswith(("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")):
            tensors[name] = np.zeros_like(tensors[name])
    tensors[f"blk.{v.n_layer}.nextn.eh_proj.weight"] = np.hstack([np.eye(sa.E), np.zeros((sa.E, sa.E))])
    tensors["output.weight"] = np.zeros((sa.V, sa.E))
    sa._write(path, v, tensors, "q8_0")
    tensors["output.weight"] = sa._codebook(path, v.n_layer, tensors[v.out_norm], 0, 4.0)
    sa._write(path, v, tensors, "q8_0")
    return str(path)


def test_the_payload_round_trips_and_refuses_what_is_out_of_range():
    assert unpack_mtp(pack_mtp(12, 7, 0.25), 512) == (12, 7, 0.25)
    for bad in (np.array([-1, 7, 5], np.int32), np.array([3, 512, 5], np.int32), np.array([3, 7, 2_000_000], np.int32),
                np.array([3, 7], np.int32)):
        with pytest.raises(ProtocolError, match="malformed MTP"):
            unpack_mtp(bad, 512)
    hdr = Header(Kind.RESULT, run_id=3, n_tokens=2, n_outputs=2, flags=Flag.MTP)
    assert [tag for tag, _, _ in payload_shapes(hdr)] == [Tag.TOKENS, Tag.MTP]
    assert Header.unpack(hdr.pack()).flags == Flag.MTP


def test_a_proposal_continues_only_the_context_it_was_made_for():
    d = MtpDrafter()
    d.prefill([1, 2, 3])
    d.offer((3, 4), 4, 9, 0.8)   # a run's last row: token 3 at position 2; the target's token after it: 4
    cut = Cutoffs(0.5, 1.0, 4, 1)
    assert [n.token for n in d.draft([1, 2, 3, 4], cut)] == [9]
    assert d.draft([1, 2, 3, 5], cut) == []                    # the target said 5 there, not 4
    assert d.draft([1, 2, 3, 4, 7], cut) == []                 # position 5: none made for it
    assert d.draft([1, 2, 3, 4], Cutoffs(0.9, 1.0, 4, 1)) == []  # below the cutoff
    for pos in range(5, 40):
        d.offer((0, 0), pos, 1, 0.5)
    assert min(d.proposals) >= 39 - 16 and d.levels()[0].n_proposed == 36


def test_the_options_refuse_in_one_line(glm):
    from click.testing import CliRunner

    from pipeinfer.cli.main import main as cli
    for args, why in ((["--draft", glm["mtp"]], "drop --draft"), (["--draft-at", "thread"], "drop --draft-at")):
        r = CliRunner().invoke(cli, ["generate", "-m", glm["mtp"], "--drafter", "mtp", "-p", "x", *args])
        assert r.exit_code != 0 and why in r.output and "Traceback" not in r.output, r.output


def test_the_mtp_head_proposes_from_the_states_it_was_fed(glm):
    """The MTP context on the MTP file: the same rows give the same proposal; a row fed again replaces what followed."""
    from pipeinfer.engine.mtp import MtpFeeder, MtpHead, ensure_mtp_file, mtp_refusal
    assert mtp_refusal(glm["mtp"]) is None and "no multi-token-prediction layers" in mtp_refusal(glm["plain"])
    head = MtpHead(ensure_mtp_file(glm["mtp"]), n_ctx=256, n_batch=64, n_threads=1)
    try:
        feeder = MtpFeeder(head)
        rng = np.random.default_rng(0)
        states = rng.standard_normal((8, head.n_embd)).astype(np.float32)
        prompt = feeder.after_run(np.array(P), np.arange(7), np.array([0] * 6 + [1]), states[:1], np.array([3]))
        step = feeder.after_run(np.array([3]), np.array([7]), np.array([1]), states[1:2], np.array([4]))
        again = feeder.after_run(np.array([3]), np.array([7]), np.array([1]), states[1:2], np.array([4]))
        other = feeder.after_run(np.array([3]), np.array([7]), np.array([1]), states[2:3], np.array([4]))
        assert prompt[0] == 8 and step[0] == again[0] == 9 and step == again and 0 < step[2] <= 1
        assert other[1] != step[1] or other[2] != step[2]   # the state is really the row's input
        assert feeder.after_run(np.array([3, 4]), np.array([7, 9]), np.array([1, 1]), states[:2], np.array([4, 5])) \
            is None                                          # not a chain of consecutive positions
    finally:
        head.close()


@pytest.mark.mpi
@pytest.mark.parametrize("family,n_ranks", [("glm4moe", 2), ("glm4moe", 3), ("deepseek2", 2), ("qwen35moe", 3)])
def test_every_mode_is_exact_with_the_targets_own_head(glm, tmp_path, family, n_ranks):
    """glm4moe; deepseek2 (attention on a latent); qwen35moe (gated delta nets: a state per drafted token)."""
    from synth_arch import make_arch_gguf
    model = glm["mtp"] if family == "glm4moe" else str(make_arch_gguf(tmp_path / f"{family}.gguf", family,
                                                                       qtype="q8_0"))
    ref = mpirun(n_ranks, {"model": model, "prompt": P, "n": N, "mode": "iterative"})["tokens"]
    for mode in ("speculative", "pipeinfer"):
        out = mpirun(n_ranks, {"model": model, "prompt": P, "n": N, "mode": mode, "drafter": "mtp",
                               "p_accept": 0.0})
        assert out["tokens"] == ref, (n_ranks, mode)
        s = out["stats"]
        assert s["n_drafted"] > 0 and s["n_spec_runs"] > 0, s   # its proposals were verified
        assert s["draft_levels"][0]["level"] == "mtp" and s["draft_levels"][0]["proposed"] >= N // 2, s
        first = s["n_kv0"] - 1 if family == "qwen35moe" else 0  # a hybrid's memory reports its state's one position
        for st in s["stage_stats"]:
            assert st["kv"] == [[0, first, s["n_kv0"] - 1]], st


@pytest.mark.mpi
@pytest.mark.parametrize("model,ranks,why", [("plain", 2, "no multi-token-prediction layers"),
                                             ("mtp", 1, "give 2 or more ranks")])
def test_a_target_it_cannot_draft_for_is_refused_in_one_line_on_every_rank(glm, model, ranks, why):
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "-m", glm[model],
           "--drafter", "mtp", "-p", "hello", "-n", "4"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("pipeinfer: error:")]
    assert p.returncode != 0 and errors and why in errors[0] and "Traceback" not in p.stderr, p.stderr[-2000:]


@pytest.mark.mpi
def test_an_mtp_head_that_agrees_is_accepted(tmp_path):
    """With an MTP head that always agrees (transparent_glm4moe), nearly every proposal is accepted and PipeInfer runs
    about one speculative run per token, in every mode exactly the iterative tokens."""
    model = transparent_glm4moe(tmp_path / "agree.gguf")
    ref = mpirun(2, {"model": model, "prompt": P, "n": N, "mode": "iterative"})["tokens"]
    for mode in ("speculative", "pipeinfer"):
        out = mpirun(2, {"model": model, "prompt": P, "n": N, "mode": mode, "drafter": "mtp", "p_accept": 0.0})
        s = out["stats"]
        assert out["tokens"] == ref, mode
        assert s["n_drafted"] >= N // 2 and s["n_draft_accepted"] >= 0.9 * s["n_drafted"], (mode, s)


def test_the_last_stage_keeps_only_recent_states():
    """The states kept stay within KEEP_STATES positions of the run being fed, however long the generation."""
    from pipeinfer.engine.mtp import KEEP_STATES, MtpFeeder

    class Head:
        n_embd = 4

        def propose(self, tokens, pos, states):
            return 1, 0.5
    feeder = MtpFeeder(Head())
    for p in range(3 * KEEP_STATES):
        feeder.after_run(np.array([5]), np.array([p]), np.array([1]), np.ones((1, 4), np.float32), np.array([6]))
    assert len(feeder.states) <= KEEP_STATES + 1 and min(feeder.states) >= 3 * KEEP_STATES - 1 - KEEP_STATES
