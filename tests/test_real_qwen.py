"""End to end on the real Qwen2.5-Coder-1.5B GGUF (`pipeinfer models fetch qwen2.5-coder-1.5b`)."""
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import mpirun

pytestmark = [pytest.mark.real, pytest.mark.mpi]
ROOT = Path(__file__).resolve().parent.parent


def real_model(name: str) -> str:
    """Path of an installed registry model; skip (or fail under PIPEINFER_REQUIRE_REAL) when missing."""
    from pipeinfer.models import ModelError, resolve_model
    try:
        return str(resolve_model(name))
    except ModelError as e:
        if os.environ.get("PIPEINFER_REQUIRE_REAL"):
            raise
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def qwen():
    return real_model("qwen2.5-coder-1.5b")


@pytest.fixture(scope="module")
def gemma():
    return real_model("gemma3-270m")


@pytest.fixture(scope="module")
def code(qwen):
    """The code prompt: (token ids, raw text, chat flag)."""
    return prompt_tokens(qwen, "code")


@pytest.fixture(scope="module")
def code_prompt(code):
    return code[0]


@pytest.fixture(scope="module")
def reference(qwen, code_prompt):
    """llama-cpp-python's own single-node greedy decoding of the whole file: 256 tokens and top-2 gaps."""
    return greedy_reference(qwen, code_prompt)


def prompt_tokens(qwen, name):
    """Token ids of prompts/NAME.txt, chat-formatted as its header says, and its raw text and chat flag."""
    from pipeinfer.cli import apply_chat, read_prompt_file
    from pipeinfer.tokenizer import Tokenizer
    text, chat = read_prompt_file(ROOT / "prompts" / f"{name}.txt")
    tok = Tokenizer(qwen)
    ids = tok.encode(apply_chat(tok, text) if chat else text)
    tok.close()
    return ids, text, bool(chat)


def greedy_reference(qwen, prompt, n=256):
    import llama_cpp
    import llama_cpp.llama_cpp as bindings
    from pipeinfer.stage import batch_invariant_model_params
    # the same numerics pipeinfer uses: flash attention, no repacked weights (stage.py explains why);
    # Llama() has no argument for the repack, so its model-params factory is swapped while it loads
    # (in the bindings module, which is where Llama looks it up)
    default = bindings.llama_model_default_params
    bindings.llama_model_default_params = batch_invariant_model_params
    try:
        llm = llama_cpp.Llama(model_path=qwen, n_ctx=1024, n_batch=512, n_threads=1, n_threads_batch=1,
                              flash_attn=True, verbose=False)  # 1 thread, like each stage in these tests
    finally:
        bindings.llama_model_default_params = default
    assert not llm.model_params.use_extra_bufts, "the reference must not use repacked weights"
    llm.eval(prompt)
    out, gaps = [], []
    for _ in range(n):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        top2 = np.sort(logits)[-2:]
        t = int(np.argmax(logits))
        out.append(t)
        gaps.append(float(top2[1] - top2[0]))
        llm.eval([t])
    llm.close()
    return out, gaps


def assert_greedy_equal(tokens, reference, near_tie: float = 0.0):
    """Token for token. With near_tie > 0, a divergence is tolerated where the reference's top-2 margin
    is below it (after which the texts differ); returns the index of that divergence or None."""
    ref, gaps = reference
    assert len(tokens) <= len(ref)
    for i, (a, b) in enumerate(zip(tokens, ref)):
        if a != b:
            assert gaps[i] < near_tie, f"differs at {i}: {a} != {b} (reference top-2 margin there {gaps[i]:.3f})"
            return i
    return None


def test_two_ranks_iterative_equals_llama_cpp_python(qwen, code_prompt, reference):
    out = mpirun(2, {"model": qwen, "prompt": code_prompt, "n": 64, "n_ctx": 1024}, timeout=600)
    assert_greedy_equal(out["tokens"], reference)
    assert len(out["tokens"]) == 64
    assert out["ranges"] == [[0, 14], [14, 28]]


def test_self_draft_speculative_accepts_all(qwen, code_prompt, reference):
    out = mpirun(2, {"model": qwen, "prompt": code_prompt, "n": 24, "n_ctx": 1024, "mode": "speculative",
                     "draft": qwen, "draft_max": 3}, timeout=600)
    assert_greedy_equal(out["tokens"], reference)
    s = out["stats"]
    assert s["n_drafted"] > 0 and s["n_draft_accepted"] == s["n_drafted"], s


def test_speculative_256_tokens_two_ranks(qwen, code_prompt, reference):
    out = mpirun(2, {"model": qwen, "prompt": code_prompt, "n": 256, "n_ctx": 1024, "mode": "speculative",
                     "drafter": "ngram", "p_accept": 0.5}, timeout=900)
    assert_greedy_equal(out["tokens"], reference)
    assert len(out["tokens"]) == 256 and out["stats"]["n_draft_accepted"] > 0


# PipeInfer frees cancelled runs' KV cells in the middle of the cache and llama.cpp refills such holes,
# so the canonical sequence's cells end up in another order than in a plain run; flash attention sums
# in cell order, so logits move in the last bits and a near-tie can flip (measured: a margin of 0.052 at
# token 20 of this prompt flipped; iterative and synchronous speculative runs keep cells in order and
# match exactly; 0.128 at token 44 of the encyclopedia prompt). Measured directly: the same 8 tokens decoded
# with their cells after a freed hole moved
# logits by up to 0.57. Until that is fixed, a divergence is tolerated only at such a near-tie.
NEAR_TIE = 0.6  # the largest shift measured from cell order was 0.57


def test_pipeinfer_256_tokens_two_ranks(qwen, code_prompt, reference):
    out = mpirun(2, {"model": qwen, "prompt": code_prompt, "n": 256, "n_ctx": 1024, "mode": "pipeinfer",
                     "drafter": "ngram", "p_accept": 0.5}, timeout=900)
    assert len(out["tokens"]) == 256
    assert_greedy_equal(out["tokens"], reference, near_tie=NEAR_TIE)
    s = out["stats"]
    assert s["n_spec_runs"] > 0 and s["n_cancelled"] > 0
    for st in s["stage_stats"]:
        assert st["kv"] == [[0, 0, s["n_kv0"] - 1]]


def test_gemma_draft_through_text_translation(qwen, gemma, code, reference):
    """Issue 6: the real Gemma 3 270M (another vocabulary) drafts for Qwen; output unchanged."""
    code_prompt, text, chat = code
    out = mpirun(2, {"model": qwen, "prompt": code_prompt, "n": 48, "n_ctx": 1024, "mode": "speculative",
                     "draft": gemma, "prompt_text": text, "chat": chat, "draft_max": 3, "p_accept": 0.3},
                 timeout=900)
    assert_greedy_equal(out["tokens"], reference)
    assert len(out["tokens"]) == 48
    s = out["stats"]
    assert s["n_drafted"] > 0 and s["acceptance_rate"] > 0.3, s


@pytest.mark.skipif(not os.environ.get("PIPEINFER_SLOW"),
                    reason="about 8 minutes per prompt on 2 cores: set PIPEINFER_SLOW=1 to run")
@pytest.mark.parametrize("name", ["code", "story", "encyclopedia"])
def test_gemma_draft_three_prompts_256_tokens(qwen, gemma, name):
    """Issue 6: Gemma (another vocabulary) drafting for Qwen on every prompt, both modes, 256 tokens."""
    ids, text, chat = prompt_tokens(qwen, name)
    # the reference is the 2-rank iterative pipeline (issue 6 asks for equality with iterative output);
    # the top-2 margins come from the single-node run. (On the story prompt the 2-rank pipeline and
    # single-node llama-cpp-python part at token 56, a 0.034 near-tie; see the closing notes.)
    _, gaps = greedy_reference(qwen, ids)
    it = mpirun(2, {"model": qwen, "prompt": ids, "n": 256, "n_ctx": 1024}, timeout=900)
    ref = (it["tokens"], gaps)
    for mode in ("speculative", "pipeinfer"):
        out = mpirun(2, {"model": qwen, "prompt": ids, "n": 256, "n_ctx": 1024, "mode": mode, "draft": gemma,
                         "prompt_text": text, "chat": chat, "draft_max": 3, "p_accept": 0.3}, timeout=900)
        assert len(out["tokens"]) == 256
        assert_greedy_equal(out["tokens"], ref, near_tie=0.0 if mode == "speculative" else NEAR_TIE)
        assert out["stats"]["n_draft_accepted"] > 0
