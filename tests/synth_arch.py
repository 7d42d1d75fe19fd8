"""Tiny synthetic GGUFs of every architecture stagefile.SPLIT_RULES admits (tests/test_architectures.py).

Each builder returns the tensors llama.cpp's loader creates for that architecture (src/models/<arch>.cpp in
llama-cpp-python 0.3.36's vendored llama.cpp; names from gguf's tables), in numpy order (the reverse of ggml's
ne), and the metadata that makes every layer-index rule of the architecture matter at this size: a sliding
window of 4 tokens (shorter than the tests' context) with another RoPE base for windowed layers, leading dense
layers that end inside a stage, an embedding scale that is not 1.

Margins: attention is weak (a small attention output, or a small post-attention norm where the architecture
normalizes the attention output), FFNs (dense or experts) strong, and where the file has its own output.weight
it becomes a codebook, as in synth.py: row succ(t) is the direction of token t's final hidden state when decoded
alone (taken from llama.cpp itself through the stage engine, so no numpy re-implementation of each graph), so
greedy decoding follows one random cycle over the vocabulary with clear top-1 margins. Tied-embedding files
(gemma2) keep random logits: their tests compare logits bit for bit, never greedy tokens across batch shapes.
"""
from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass, field
from typing import Callable

import gguf
import numpy as np

from synth import N_SPECIAL, add_vocab

E, H, KV, HD, FF, V = 64, 4, 2, 16, 128, 256     # n_embd, heads, kv heads, head size, n_ff, vocabulary
X, XU, FX = 4, 2, 32                              # experts, experts used per token, expert n_ff
SWA = 4                                           # sliding window (tokens): shorter than the tests' context


@dataclass(frozen=True)
class Variant:
    """One synthetic model: an architecture with the metadata and tensors of one of its forms."""
    name: str                      # test id, e.g. "llama-moe"
    arch: str                      # general.architecture
    layer: Callable                # (rng, il, n_layer) -> {tensor suffix: array} of block il
    n_layer: int = 6
    keys: dict = field(default_factory=dict)   # extra "{arch}.<suffix>" -> value (int: u32, float: f32, bool)
    tied: bool = False             # no output.weight: the output projection is token_embd
    n_nextn: int = 0               # trailing multi-token-prediction blocks (never run by a plain decode)


def _mat(r, n_out, n_in, gain=1.0):
    return r.standard_normal((n_out, n_in)) * gain / np.sqrt(n_in)


def _experts(r, n_out, n_in, gain=1.0):
    return r.standard_normal((X, n_out, n_in)) * gain / np.sqrt(n_in)


def _gains(n_layer):
    # weak attention, strong FFN, both shrinking with depth (synth.py's choice)
    return 0.3 / np.sqrt(n_layer), 1.5 * min(1.0, np.sqrt(6 / n_layer))


def _attn(r, n_layer, *, q_out=H * HD, kv_out=KV * HD, post_norm=False, bias=False):
    g_attn, _ = _gains(n_layer)
    t = {"attn_q.weight": _mat(r, q_out, E), "attn_k.weight": _mat(r, kv_out, E), "attn_v.weight": _mat(r, kv_out, E),
         # a post-attention norm rescales the output anyway: weaken attention through that norm instead
         "attn_output.weight": _mat(r, E, q_out, 1.0 if post_norm else g_attn)}
    if post_norm:
        t["post_attention_norm.weight"] = np.full(E, 0.1)
    if bias:
        t |= {"attn_q.bias": 0.1 * r.standard_normal(q_out), "attn_k.bias": 0.1 * r.standard_normal(kv_out),
              "attn_v.bias": 0.1 * r.standard_normal(kv_out)}
    return t


def _ffn(r, n_layer, n_ff=FF, fused_up=False):
    _, g_ffn = _gains(n_layer)
    if fused_up:  # phi3: ffn_up holds gate and up, [2 n_ff, n_embd]
        return {"ffn_up.weight": _mat(r, 2 * n_ff, E), "ffn_down.weight": _mat(r, E, n_ff, g_ffn)}
    return {"ffn_gate.weight": _mat(r, n_ff, E), "ffn_up.weight": _mat(r, n_ff, E),
            "ffn_down.weight": _mat(r, E, n_ff, g_ffn)}


def _moe(r, n_layer, n_ff=FX):
    _, g_ffn = _gains(n_layer)
    return {"ffn_gate_inp.weight": _mat(r, X, E, 3.0),   # decisive routing
            "ffn_gate_exps.weight": _experts(r, n_ff, E), "ffn_up_exps.weight": _experts(r, n_ff, E),
            "ffn_down_exps.weight": _experts(r, E, n_ff, g_ffn * np.sqrt(2))}


def _norms(*names):
    return {f"{n}.weight": np.ones(E) for n in names}


def _qk_norm(q=HD, k=HD):
    return {"attn_q_norm.weight": np.ones(q), "attn_k_norm.weight": np.ones(k)}


# ---------------------------------------------------------------- one block per architecture
def _llama(r, il, n):
    return _norms("attn_norm", "ffn_norm") | _attn(r, n) | _ffn(r, n)


def _llama_moe(r, il, n):  # Mixtral: llama with experts (n_ff is the expert size)
    return _norms("attn_norm", "ffn_norm") | _attn(r, n) | _moe(r, n, FF)


def _qwen2(r, il, n):
    return _norms("attn_norm", "ffn_norm") | _attn(r, n, bias=True) | _ffn(r, n)


def _qwen3(r, il, n):
    return _norms("attn_norm", "ffn_norm") | _attn(r, n) | _qk_norm() | _ffn(r, n)


def _qwen3moe(r, il, n):
    return _norms("attn_norm", "ffn_norm") | _attn(r, n) | _qk_norm() | _moe(r, n)


def _gemma2(r, il, n):
    return _norms("attn_norm", "ffn_norm", "post_ffw_norm") | _attn(r, n, post_norm=True) | _ffn(r, n)


def _gemma3(r, il, n):
    return _gemma2(r, il, n) | _qk_norm()


def _phi3(r, il, n):  # fused QKV, fused gate+up
    g_attn, _ = _gains(n)
    return (_norms("attn_norm", "ffn_norm") | {"attn_qkv.weight": _mat(r, E + 2 * KV * HD, E),
                                               "attn_output.weight": _mat(r, E, E, g_attn)} | _ffn(r, n, fused_up=True))


def _olmo2(r, il, n):  # post-norm only; q/k norms over all heads
    return _norms("post_ffw_norm") | _attn(r, n, post_norm=True) | _qk_norm(E, KV * HD) | _ffn(r, n)


def _granite(r, il, n):
    return _llama(r, il, n)


DS_LEAD, DS_QLORA, DS_KVLORA, DS_ROPE, DS_NOPE, DS_V = 2, 32, 32, 16, 16, 16


def _deepseek2(r, il, n):
    """MLA attention (q through a low-rank a/b pair, k/v from one compressed vector, absorbed k_b/v_b), dense FFN
    in the first DS_LEAD blocks, then routed experts with a score-correction bias and one shared expert."""
    g_attn, _ = _gains(n)
    k_mla = DS_NOPE + DS_ROPE
    t = _norms("attn_norm", "ffn_norm") | {
        "attn_q_a.weight": _mat(r, DS_QLORA, E), "attn_q_a_norm.weight": np.ones(DS_QLORA),
        "attn_q_b.weight": _mat(r, H * k_mla, DS_QLORA),
        "attn_kv_a_mqa.weight": _mat(r, DS_KVLORA + DS_ROPE, E), "attn_kv_a_norm.weight": np.ones(DS_KVLORA),
        "attn_k_b.weight": r.standard_normal((H, DS_KVLORA, DS_NOPE)) / np.sqrt(DS_NOPE),
        "attn_v_b.weight": r.standard_normal((H, DS_V, DS_KVLORA)) / np.sqrt(DS_KVLORA),
        "attn_output.weight": _mat(r, E, H * DS_V, g_attn)}
    if il < DS_LEAD:
        return t | _ffn(r, n)
    _, g_ffn = _gains(n)
    t |= _moe(r, n) | {"exp_probs_b.bias": 0.1 * r.standard_normal(X),
                       "ffn_gate_shexp.weight": _mat(r, FX, E), "ffn_up_shexp.weight": _mat(r, FX, E),
                       "ffn_down_shexp.weight": _mat(r, E, FX, g_ffn)}
    if il >= n:  # the multi-token-prediction block after the trunk (GLM-4.7-Flash style)
        t |= {"nextn.eh_proj.weight": _mat(r, E, 2 * E)} | _norms("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm")
    return t


def _gpt_oss(r, il, n):
    """Attention sinks and biases, windowed attention on even layers, experts with biases (SwiGLU-OAI)."""
    t = _norms("attn_norm", "post_attention_norm") | _attn(r, n, bias=True) | _moe(r, n)
    return t | {"attn_output.bias": 0.02 * r.standard_normal(E), "attn_sinks.weight": r.standard_normal(H),
                "ffn_gate_inp.bias": 0.1 * r.standard_normal(X),
                "ffn_gate_exps.bias": 0.02 * r.standard_normal((X, FX)),
                "ffn_up_exps.bias": 0.02 * r.standard_normal((X, FX)),
                "ffn_down_exps.bias": 0.02 * r.standard_normal((X, E))}


_MOE_KEYS = {"expert_count": X, "expert_used_count": XU}
_SWA_KEYS = {"attention.sliding_window": SWA, "rope.freq_base_swa": 1000.0}

VARIANTS = {v.name: v for v in [
    Variant("llama", "llama", _llama),
    Variant("llama-moe", "llama", _llama_moe, keys=_MOE_KEYS),
    Variant("qwen2", "qwen2", _qwen2),
    Variant("qwen3", "qwen3", _qwen3),
    Variant("qwen3moe", "qwen3moe", _qwen3moe, keys=_MOE_KEYS | {"expert_feed_forward_length": FX}),
    Variant("gemma2", "gemma2", _gemma2, tied=True,
            keys=_SWA_KEYS | {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    Variant("gemma3", "gemma3", _gemma3, keys=_SWA_KEYS),
    Variant("phi3", "phi3", _phi3),
    Variant("olmo2", "olmo2", _olmo2, keys=_SWA_KEYS),
    Variant("granite", "granite", _granite,
            keys={"logit_scale": 2.0, "residual_scale": 0.5, "embedding_scale": 6.0, "attention.scale": 0.2}),
    Variant("deepseek2", "deepseek2", _deepseek2, n_nextn=1, keys=_MOE_KEYS | {
        "leading_dense_block_count": DS_LEAD, "expert_feed_forward_length": FX, "expert_shared_count": 1,
        "expert_weights_scale": 1.5, "expert_weights_norm": True, "expert_gating_func": 2,  # sigmoid
        "attention.q_lora_rank": DS_QLORA, "attention.kv_lora_rank": DS_KVLORA,
        "attention.key_length": DS_KVLORA + DS_ROPE, "attention.value_length": DS_KVLORA,
        "attention.key_length_mla": DS_NOPE + DS_ROPE, "attention.value_length_mla": DS_V,
        "rope.dimension_count": DS_ROPE, "attention.head_count_kv": 1}),
    Variant("gpt-oss", "gpt-oss", _gpt_oss, keys=_MOE_KEYS | _SWA_KEYS | {"expert_feed_forward_length": FX}),
]}


# ---------------------------------------------------------------- writing
def _write(path, v: Variant, tensors: dict, qtype: str) -> None:
    w = gguf.GGUFWriter(str(path), v.arch)
    w.add_name("synthetic")  # llama.cpp reads the name too: "phi3" in it asks for a Phi-3 vocabulary
    keys = {"context_length": 2048, "embedding_length": E, "block_count": v.n_layer + v.n_nextn,
            "feed_forward_length": FF, "attention.head_count": H, "attention.head_count_kv": KV,
            "rope.dimension_count": HD, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0}
    if v.n_nextn:
        keys["nextn_predict_layers"] = v.n_nextn
    for k, val in (keys | v.keys).items():
        name = f"{v.arch}.{k}"
        if isinstance(val, bool):
            w.add_bool(name, val)
        elif isinstance(val, int):
            w.add_uint32(name, val)
        else:
            w.add_float32(name, val)
    add_vocab(w, V)
    for name, arr in tensors.items():
        arr = arr.astype(np.float32)
        if qtype == "q8_0" and arr.ndim >= 2 and arr.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _codebook(path, n_layer, out_norm, seed, logit_scale):
    """output.weight whose row succ(t) is the unit direction of token t's final hidden state decoded alone."""
    from pipeinfer.core.protocol import Batch, kv_ops
    from pipeinfer.engine.stage import StageEngine
    toks = np.arange(N_SPECIAL, V, dtype=np.int32)
    n = len(toks)
    with StageEngine(path, n_ctx=n + 8, n_batch=n, n_seq_max=n, n_threads=1, n_threads_batch=1,
                     embd_input=False, capture_hidden=True) as eng:
        # each token alone in its own sequence at position 0: one batch, no token sees another
        h = eng.decode(Batch(toks, np.zeros(n, np.int32), [[i] for i in range(n)], np.ones(n, np.int32), kv_ops()))
    h = h.astype(np.float64)
    h = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5) * out_norm      # the final RMS norm
    m = h.mean(0) / np.linalg.norm(h.mean(0))
    y = h - np.outer(h @ m, m)                                               # drop the shared direction
    rng = np.random.default_rng(seed + 1000)
    perm = N_SPECIAL + rng.permutation(n)
    succ = np.zeros(V, dtype=np.int64)
    succ[perm] = np.roll(perm, -1)
    out = np.zeros((V, E))
    out[succ[N_SPECIAL:]] = y / np.linalg.norm(y, axis=1, keepdims=True)
    return out * logit_scale


def make_arch_gguf(path, name: str, *, seed: int = 0, qtype: str = "f32", logit_scale: float = 4.0,
                   keys: dict | None = None) -> pathlib.Path:
    """Write the synthetic model VARIANTS[name] to path (f32, or q8_0 for matrices whose rows allow it);
    keys: more "{arch}.<suffix>" metadata, or other values for the variant's."""
    path = pathlib.Path(path)
    v = VARIANTS[name]
    if keys:
        v = dataclasses.replace(v, keys=v.keys | keys)
    r = np.random.default_rng(seed)
    tensors = {"token_embd.weight": r.standard_normal((V, E)), "output_norm.weight": np.ones(E)}
    if v.tied:
        # logits are token_embd @ h: small embeddings let the layers, not the token's own row, set h's direction
        # (otherwise greedy decoding repeats its input), and a large output norm keeps the logits apart
        tensors["token_embd.weight"] *= 0.1
        tensors["output_norm.weight"] *= 10.0
    for il in range(v.n_layer + v.n_nextn):
        tensors |= {f"blk.{il}.{k}": a for k, a in v.layer(r, il, v.n_layer).items()}
    if not v.tied:
        tensors["output.weight"] = np.zeros((V, E))
        _write(path, v, tensors, qtype)
        tensors["output.weight"] = _codebook(path, v.n_layer, tensors["output_norm.weight"], seed, logit_scale)
    _write(path, v, tensors, qtype)
    return path
