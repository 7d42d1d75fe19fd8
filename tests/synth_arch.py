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
    top: Callable | None = None    # (rng) -> {tensor name: array} outside the blocks (the output norm's bias, ...)
    global_keys: dict = field(default_factory=dict)  # metadata outside "{arch}." (apertus's "xielu.*")
    out_norm: str = "output_norm.weight"  # the output norm's tensor name (lfm2's is token_embd_norm.weight)


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


# ---- glm4, llama4, deepseek32, mistral4 (issue 55)
GLM_LEAD, L4_STEP, IX_HEADS, IX_HEAD, IX_TOP_K = 2, 2, 2, 64, 4


def _glm4(r, il, n):
    """GLM-4 dense: fused QKV with bias, a norm after attention (weak: 0.1) and after the (fused gate+up) FFN."""
    qkv = H * HD + 2 * KV * HD
    return (_norms("attn_norm", "ffn_norm", "post_ffw_norm")
            | {"attn_qkv.weight": _mat(r, qkv, E), "attn_qkv.bias": 0.1 * r.standard_normal(qkv),
               "attn_output.weight": _mat(r, E, H * HD), "post_attention_norm.weight": np.full(E, 0.1)}
            | _ffn(r, n, fused_up=True))


def _shared_expert(r, n, n_ff=FX):
    _, g_ffn = _gains(n)
    return {"ffn_gate_shexp.weight": _mat(r, n_ff, E), "ffn_up_shexp.weight": _mat(r, n_ff, E),
            "ffn_down_shexp.weight": _mat(r, E, n_ff, g_ffn)}


def _glm4moe(r, il, n):
    """GLM-4.5/4.6/4.7: q/k/v with bias and q/k norms, GLM_LEAD dense FFN layers, then routed experts with a
    score-correction bias and a shared expert (no ffn_norm: post_attention_norm is the FFN's input norm), and a
    multi-token-prediction block after the trunk."""
    t = _norms("attn_norm", "post_attention_norm") | _attn(r, n, bias=True) | _qk_norm()
    if il < GLM_LEAD:
        return t | _ffn(r, n)
    t |= _moe(r, n) | {"exp_probs_b.bias": 0.1 * r.standard_normal(X)} | _shared_expert(r, n)
    if il >= n:
        t |= {"nextn.eh_proj.weight": _mat(r, E, 2 * E)} | _norms("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm")
    return t


def _llama4(r, il, n):
    """Llama 4: experts (sigmoid-weighted before the FFN) and a shared expert in layers with (il + 1) % L4_STEP == 0,
    a dense FFN in the others."""
    t = _norms("attn_norm", "ffn_norm") | _attn(r, n)
    if (il + 1) % L4_STEP:
        return t | _ffn(r, n)
    return t | _moe(r, n) | _shared_expert(r, n)


def _deepseek32(r, il, n):
    """DeepSeek-V3.2: deepseek2's MLA, experts and prediction block, plus the lightning indexer's tensors (its top
    IX_TOP_K keys decide which cached tokens each query attends to)."""
    t = _deepseek2(r, il, n)
    return t | {"indexer.k_norm.weight": np.ones(IX_HEAD), "indexer.k_norm.bias": 0.1 * r.standard_normal(IX_HEAD),
                "indexer.proj.weight": _mat(r, IX_HEADS, E), "indexer.attn_k.weight": _mat(r, IX_HEAD, E, 3.0),
                "indexer.attn_q_b.weight": _mat(r, IX_HEADS * IX_HEAD, DS_QLORA, 3.0)}


def _mistral4(r, il, n):
    """Mistral 4: deepseek2's loader and graph (RoPE on adjacent pairs), experts' gate and up fused."""
    t = _deepseek2(r, il, n)
    if "ffn_gate_exps.weight" in t:
        t["ffn_gate_up_exps.weight"] = np.concatenate([t.pop("ffn_gate_exps.weight"), t.pop("ffn_up_exps.weight")], 1)
    return t


_MLA_KEYS = {"expert_count": X, "expert_used_count": XU, "leading_dense_block_count": DS_LEAD,
             "expert_feed_forward_length": FX, "expert_shared_count": 1, "expert_weights_scale": 1.5,
             "expert_weights_norm": True, "attention.q_lora_rank": DS_QLORA, "attention.kv_lora_rank": DS_KVLORA,
             "attention.key_length": DS_KVLORA + DS_ROPE, "attention.value_length": DS_KVLORA,
             "attention.key_length_mla": DS_NOPE + DS_ROPE, "attention.value_length_mla": DS_V,
             "rope.dimension_count": DS_ROPE, "attention.head_count_kv": 1}


# ---- dense and MoE families (issue 55)
LEAD, SH = 2, 32            # leading dense layers (dots1, bailingmoe2, ernie4_5-moe), shared-expert n_ff


def _biased(r, t, *names):
    """t with a small bias beside each named weight (a norm's bias is its own size, a matrix's its rows)."""
    return t | {f"{n}.bias": 0.05 * r.standard_normal(t[f"{n}.weight"].shape[0]) for n in names}


def _exp_bias(r):
    return {"exp_probs_b.bias": 0.1 * r.standard_normal(X)}


def _ffn_no_gate(r, n):  # sequential up -> activation -> down (starcoder2, arcee, apertus)
    _, g_ffn = _gains(n)
    return {"ffn_up.weight": _mat(r, FF, E), "ffn_down.weight": _mat(r, E, FF, g_ffn)}


def _qwen2moe(r, il, n):
    """Routed experts beside a shared expert whose output a sigmoid gate (ffn_gate_inp_shexp, one row) scales."""
    return (_norms("attn_norm", "ffn_norm") | _attn(r, n, bias=True) | _moe(r, n) | _shared_expert(r, n, SH)
            | {"ffn_gate_inp_shexp.weight": _mat(r, 1, E, 3.0)[0]})


def _olmoe(r, il, n):  # q/k norms over all heads (as many kv heads as heads); experts of n_ff
    return _norms("attn_norm", "ffn_norm") | _attn(r, n, kv_out=H * HD) | _qk_norm(E, E) | _moe(r, n)


def _granitemoe(r, il, n):  # granite's graph with experts and a shared expert
    return _norms("attn_norm", "ffn_norm") | _attn(r, n) | _moe(r, n) | _shared_expert(r, n, SH)


def _cohere(r, il, n):  # command-r, cohere2: one LayerNorm feeds attention and the FFN in parallel
    return _norms("attn_norm") | _attn(r, n) | _ffn(r, n)


def _minimax_m2(r, il, n):  # q/k norms over all heads, sigmoid-gated experts with a score-correction bias
    return (_norms("attn_norm", "ffn_norm") | _attn(r, n) | _qk_norm(H * HD, KV * HD) | _moe(r, n)
            | _exp_bias(r))


def _ernie4_5_moe(r, il, n):
    t = _norms("attn_norm", "ffn_norm") | _attn(r, n)
    if il < LEAD:
        return t | _ffn(r, n)
    return t | _moe(r, n) | _exp_bias(r) | _shared_expert(r, n, SH)


def _exaone4(r, il, n):  # no pre-norms: a norm after attention and after the FFN, q/k norms per head
    return _attn(r, n, post_norm=True) | _qk_norm() | _ffn(r, n) | _norms("post_ffw_norm")


def _seed_oss(r, il, n):  # post_attention_norm is the FFN's input norm here
    return _norms("attn_norm", "post_attention_norm") | _attn(r, n, bias=True) | _ffn(r, n)


def _starcoder2(r, il, n):  # LayerNorms with biases, biased projections, a GELU FFN without gate
    t = _norms("attn_norm", "ffn_norm") | _attn(r, n, bias=True) | _ffn_no_gate(r, n)
    return _biased(r, t, "attn_norm", "ffn_norm", "attn_output", "ffn_up", "ffn_down")


def _hunyuan_moe(r, il, n):
    return _norms("attn_norm", "ffn_norm") | _attn(r, n) | _qk_norm() | _moe(r, n) | _shared_expert(r, n, SH)


def _dots1(r, il, n):  # as many kv heads as heads; LEAD dense layers, then experts and a shared expert
    t = _norms("attn_norm", "ffn_norm") | _attn(r, n, kv_out=H * HD) | _qk_norm()
    if il < LEAD:
        return t | _ffn(r, n)
    return t | _moe(r, n) | _exp_bias(r) | _shared_expert(r, n, FX)


def _bailingmoe2(r, il, n):
    """Ling 2.0: fused QKV, q/k norms, LEAD dense layers, then grouped sigmoid-routed experts and a shared expert;
    a multi-token-prediction block after the trunk."""
    g_attn, _ = _gains(n)
    t = (_norms("attn_norm", "ffn_norm") | _qk_norm()
         | {"attn_qkv.weight": _mat(r, H * HD + 2 * KV * HD, E), "attn_output.weight": _mat(r, E, H * HD, g_attn)})
    if il < LEAD:
        return t | _ffn(r, n)
    t |= _moe(r, n) | _exp_bias(r) | _shared_expert(r, n, FX)
    if il >= n:
        t |= {"nextn.eh_proj.weight": _mat(r, E, 2 * E)} | _norms("nextn.enorm", "nextn.hnorm", "layer_output_norm")
    return t


def _arcee(r, il, n):  # llama with a ReLU^2 FFN without gate
    return _norms("attn_norm", "ffn_norm") | _attn(r, n) | _ffn_no_gate(r, n)


def _apertus(r, il, n):  # q/k norms, an xIELU FFN without gate (its parameters per layer: APERTUS_XIELU)
    return _norms("attn_norm", "ffn_norm") | _attn(r, n) | _qk_norm() | _ffn_no_gate(r, n)


def _phimoe(r, il, n):
    t = _norms("attn_norm", "ffn_norm") | _attn(r, n, bias=True) | _moe(r, n)
    return _biased(r, t, "attn_norm", "ffn_norm", "attn_output")


def _dbrx(r, il, n):  # fused QKV; attn_output_norm is the FFN's input norm
    g_attn, _ = _gains(n)
    return (_norms("attn_norm", "attn_output_norm") | _moe(r, n)
            | {"attn_qkv.weight": _mat(r, E + 2 * KV * HD, E), "attn_output.weight": _mat(r, E, E, g_attn)})


def _grok(r, il, n):  # norms after attention and after the FFN; a dense FFN beside the experts (Grok 2)
    t = _norms("attn_norm", "ffn_norm", "layer_output_norm") | _attn(r, n, post_norm=True) | _ffn(r, n) | _moe(r, n)
    t["attn_output_norm.weight"] = t.pop("post_attention_norm.weight")
    return t


def _afmoe(r, il, n):
    """AFMoE (Arcee Trinity): norms before and after attention and FFN, q/k norms, a sigmoid gate on the attention
    output; LEAD dense layers, then sigmoid-routed experts with a bias and a shared expert."""
    t = (_norms("attn_norm", "ffn_norm", "post_ffw_norm") | _attn(r, n, post_norm=True) | _qk_norm()
         | {"attn_gate.weight": _mat(r, H * HD, E)})
    if il < LEAD:
        return t | _ffn(r, n)
    return t | _moe(r, n) | _exp_bias(r) | _shared_expert(r, n, FX)


def _norm_biases(r):  # the output LayerNorm's bias (starcoder2, phimoe; phimoe's output bias beside it), zero
    return {"output_norm.bias": np.zeros(E)}


APERTUS_XIELU = {"xielu.alpha_n": [0.8, 0.3, 1.2, 0.5, 1.0, 0.6], "xielu.alpha_p": [0.8, 0.4, 1.1, 0.6, 0.9, 0.5],
                 "xielu.beta": [0.5, 0.3, 0.7, 0.4, 0.6, 0.2], "xielu.eps": [-1e-6] * 6}


_MOE_KEYS = {"expert_count": X, "expert_used_count": XU}
_SWA_KEYS = {"attention.sliding_window": SWA, "rope.freq_base_swa": 1000.0}

# ---- hybrid and recurrent families (issue 55)
# Attention and a recurrent mixer per layer, chosen by the per-layer head_count_kv (0: recurrent), so that the 2- and
# 3-stage cuts of test_architectures.ARCH_CUTS give every stage a layer of each kind (llama.cpp aborts on a hybrid
# file without: core/recurrent.py). The mixers are as weak as attention (the FFNs carry the codebook's margins).
LFM2_CONV = 3                                     # short convolution's l_cache (its window: 2 past tokens and this)
SSM_CONV, SSM_STATE, SSM_HEADS, SSM_GROUPS = 4, 16, 8, 1   # Mamba2: conv kernel, state, heads, groups
SSM_INNER = 2 * E                                 # llama.cpp supports an expansion factor of 2 only


def _lfm2_attn(il):
    return il % 2 == 1                            # attention on odd layers, short convolution on even ones


def _lfm2(r, il, n):
    """LFM2 (models/lfm2.cpp): operator norm, then attention (q/k norms) or a gated short convolution (in_proj to
    b, c, x; causal conv over b*x; c * conv; out_proj); dense SwiGLU FFN everywhere."""
    t = _norms("attn_norm", "ffn_norm") | _ffn(r, n)
    if _lfm2_attn(il):
        return t | _attn(r, n) | _qk_norm()
    g_attn, _ = _gains(n)
    return t | {"shortconv.conv.weight": r.standard_normal((E, LFM2_CONV)) / np.sqrt(LFM2_CONV),
                "shortconv.in_proj.weight": _mat(r, 3 * E, E), "shortconv.out_proj.weight": _mat(r, E, E, g_attn)}


def _granitehybrid_attn(il):
    return il % 2 == 0                            # attention on even layers, Mamba2 on odd ones


def _mamba2(r, n):
    """A Mamba2 mixer as granite-hybrid.cpp loads it: in_proj to z, x, B, C, dt; conv1d over x, B, C; A, D and dt
    bias per head; grouped RMS norm; out_proj."""
    g_attn, _ = _gains(n)
    n_xbc = SSM_INNER + 2 * SSM_GROUPS * SSM_STATE
    return {"ssm_in.weight": _mat(r, 2 * SSM_INNER + 2 * SSM_GROUPS * SSM_STATE + SSM_HEADS, E),
            "ssm_conv1d.weight": r.standard_normal((n_xbc, SSM_CONV)) / np.sqrt(SSM_CONV),
            "ssm_conv1d.bias": 0.1 * r.standard_normal(n_xbc),
            "ssm_dt.bias": 0.5 * r.standard_normal(SSM_HEADS) - 1.0,
            "ssm_a": -np.exp(r.uniform(0.0, 1.0, (SSM_HEADS, 1))), "ssm_d": np.ones((SSM_HEADS, 1)),
            "ssm_norm.weight": np.ones((SSM_GROUPS, SSM_INNER // SSM_GROUPS)),
            "ssm_out.weight": _mat(r, E, SSM_INNER, g_attn)}


def _granitehybrid(r, il, n):
    """Granite 4.0-H (models/granite-hybrid.cpp): attention or Mamba2, then a dense SwiGLU FFN, granite's scales."""
    return _norms("attn_norm", "ffn_norm") | _ffn(r, n) | (_attn(r, n) if _granitehybrid_attn(il) else _mamba2(r, n))


DN_STATE, DN_GROUPS, DN_HEADS, DN_CONV = 16, 2, 4, 4   # gated delta net: head size, k heads, v heads, conv kernel
QN_INTERVAL = 2                                   # qwen3next: full attention where (il + 1) % 2 == 0 (odd layers)


def _qwen3next(r, il, n):
    """Qwen3-Next (models/qwen3next.cpp: load_arch_tensors): attention whose q projection holds a sigmoid gate beside
    the query (q/k norms), or a gated delta net (fused qkv and the z gate, conv1d over qkv, dt bias and A per v head,
    beta and alpha in one projection, a norm per head, out projection); post_attention_norm is the FFN's input norm;
    routed experts beside a shared expert gated by a sigmoid (ffn_gate_inp_shexp); the prediction block after the
    trunk attends."""
    return _qwen35(r, il, n, moe=True, fused_beta_alpha=True)


def _delta_net(r, n, beta_alpha):
    """A gated delta net's tensors (qwen3next.cpp, qwen35.cpp, qwen35moe.cpp), beta and alpha as given."""
    g_attn, _ = _gains(n)
    key_dim, value_dim = DN_STATE * DN_GROUPS, DN_STATE * DN_HEADS
    conv_dim = 2 * key_dim + value_dim
    return {"attn_qkv.weight": _mat(r, conv_dim, E), "attn_gate.weight": _mat(r, value_dim, E),
            "ssm_conv1d.weight": r.standard_normal((conv_dim, DN_CONV)) / np.sqrt(DN_CONV),
            "ssm_dt.bias": 0.5 * r.standard_normal(DN_HEADS) - 1.0,
            "ssm_a": -np.exp(r.uniform(0.0, 1.0, DN_HEADS)), "ssm_norm.weight": np.ones(DN_STATE),
            "ssm_out.weight": _mat(r, E, value_dim, g_attn)} | beta_alpha


def _qwen35(r, il, n, moe=False, fused_beta_alpha=False):
    """Qwen3.5 (models/qwen35.cpp; qwen35moe.cpp with moe): qwen3next's blocks, beta and alpha in projections of
    their own (fused into one, ssm_ba, in qwen3next), a dense SwiGLU FFN (or qwen3next's experts and gated shared
    expert), an M-RoPE model."""
    g_attn, _ = _gains(n)
    t = _norms("attn_norm", "post_attention_norm")
    t |= (_moe(r, n) | _shared_expert(r, n, SH) | {"ffn_gate_inp_shexp.weight": _mat(r, 1, E, 3.0)[0]}) if moe \
        else _ffn(r, n)
    if il >= n or (il + 1) % QN_INTERVAL == 0:
        t |= _attn(r, n, q_out=2 * H * HD) | _qk_norm()
        t["attn_output.weight"] = _mat(r, E, H * HD, g_attn)
        if il >= n:
            t |= {"nextn.eh_proj.weight": _mat(r, E, 2 * E)} | _norms("nextn.enorm", "nextn.hnorm",
                                                                      "nextn.shared_head_norm")
        return t
    beta_alpha = {"ssm_ba.weight": _mat(r, 2 * DN_HEADS, E)} if fused_beta_alpha else \
        {"ssm_beta.weight": _mat(r, DN_HEADS, E), "ssm_alpha.weight": _mat(r, DN_HEADS, E)}
    return t | _delta_net(r, n, beta_alpha)


def _qwen35moe(r, il, n):
    return _qwen35(r, il, n, moe=True)


_QWEN3NEXT_KEYS = {
    "ssm.conv_kernel": DN_CONV, "ssm.inner_size": DN_STATE * DN_HEADS, "ssm.state_size": DN_STATE,
    "ssm.time_step_rank": DN_HEADS, "ssm.group_count": DN_GROUPS, "full_attention_interval": QN_INTERVAL,
    "expert_count": X, "expert_used_count": XU, "expert_feed_forward_length": FX,
    "expert_shared_feed_forward_length": SH, "rope.dimension_count": HD // 2}
_QWEN35_KEYS = {k: x for k, x in _QWEN3NEXT_KEYS.items() if not k.startswith("expert")} | {
    "rope.dimension_sections": [2, 1, 1, 0]}     # M-RoPE over the 8 rotated dimensions' 4 pairs

_GRANITE_HYBRID_KEYS = {
    "ssm.conv_kernel": SSM_CONV, "ssm.inner_size": SSM_INNER, "ssm.state_size": SSM_STATE,
    "ssm.time_step_rank": SSM_HEADS, "ssm.group_count": SSM_GROUPS,
    "attention.head_count_kv": [KV if _granitehybrid_attn(il) else 0 for il in range(6)],
    "logit_scale": 2.0, "residual_scale": 0.5, "embedding_scale": 6.0, "attention.scale": 0.2}

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
    Variant("glm4", "glm4", _glm4, keys={"rope.dimension_count": HD // 2}),
    Variant("glm4moe", "glm4moe", _glm4moe, n_nextn=1, keys=_MOE_KEYS | {
        "leading_dense_block_count": GLM_LEAD, "expert_feed_forward_length": FX, "expert_shared_count": 1,
        "expert_weights_scale": 2.5, "expert_weights_norm": True, "expert_gating_func": 2,
        "rope.dimension_count": HD // 2}),
    Variant("llama4", "llama4", _llama4, n_layer=12, keys=_MOE_KEYS | {  # its stages hold 4 layers or more
        "interleave_moe_layer_step": L4_STEP, "expert_feed_forward_length": FX, "rope.freq_base_swa": 1000.0}),
    Variant("deepseek32", "deepseek32", _deepseek32, n_nextn=1, keys=_MLA_KEYS | {
        "expert_gating_func": 2, "attention.indexer.head_count": IX_HEADS, "attention.indexer.key_length": IX_HEAD,
        "attention.indexer.top_k": IX_TOP_K}),
    Variant("mistral4", "mistral4", _mistral4, keys=_MLA_KEYS | {  # expert gating unset: llama.cpp guesses it
        "attention.temperature_scale": 0.1, "attention.temperature_length": 4}),
    # ---- dense and MoE families (issue 55)
    Variant("mistral3", "mistral3", _llama, keys={"attention.temperature_scale": 0.5,
                                                  "rope.scaling.original_context_length": 8}),
    Variant("qwen2moe", "qwen2moe", _qwen2moe, keys=_MOE_KEYS | {"expert_feed_forward_length": FX,
                                                                 "expert_shared_feed_forward_length": SH}),
    Variant("olmoe", "olmoe", _olmoe, keys=_MOE_KEYS | {"feed_forward_length": FX, "attention.head_count_kv": H}),
    Variant("granitemoe", "granitemoe", _granitemoe, keys=_MOE_KEYS | {
        "feed_forward_length": FX, "expert_shared_feed_forward_length": SH,
        "logit_scale": 2.0, "residual_scale": 0.5, "embedding_scale": 6.0, "attention.scale": 0.2}),
    Variant("cohere2", "cohere2", _cohere, tied=True,
            keys=_SWA_KEYS | {"logit_scale": 4.0, "attention.layer_norm_epsilon": 1e-5}),
    Variant("command-r", "command-r", _cohere, tied=True,
            keys={"logit_scale": 4.0, "attention.layer_norm_epsilon": 1e-5}),
    Variant("gemma", "gemma", _llama, tied=True),
    Variant("minimax-m2", "minimax-m2", _minimax_m2, keys=_MOE_KEYS | {
        "feed_forward_length": FX, "expert_feed_forward_length": FX, "expert_gating_func": 2,
        "rope.dimension_count": HD // 2}),
    Variant("ernie4_5", "ernie4_5", _llama),
    Variant("ernie4_5-moe", "ernie4_5-moe", _ernie4_5_moe, keys=_MOE_KEYS | {
        "leading_dense_block_count": LEAD, "interleave_moe_layer_step": 1, "expert_feed_forward_length": FX,
        "expert_shared_feed_forward_length": SH}),
    Variant("exaone4", "exaone4", _exaone4),
    Variant("seed_oss", "seed_oss", _seed_oss),
    Variant("starcoder2", "starcoder2", _starcoder2, top=_norm_biases, keys={"attention.layer_norm_epsilon": 1e-5}),
    Variant("hunyuan-moe", "hunyuan-moe", _hunyuan_moe, keys=_MOE_KEYS | {
        "feed_forward_length": FX, "expert_feed_forward_length": FX, "expert_shared_feed_forward_length": SH}),
    Variant("dots1", "dots1", _dots1, keys=_MOE_KEYS | {
        "attention.head_count_kv": H, "leading_dense_block_count": LEAD, "expert_feed_forward_length": FX,
        "expert_shared_count": 1, "expert_weights_scale": 2.5, "expert_weights_norm": True, "expert_gating_func": 2}),
    Variant("bailingmoe2", "bailingmoe2", _bailingmoe2, n_nextn=1, keys=_MOE_KEYS | {
        "leading_dense_block_count": LEAD, "expert_feed_forward_length": FX, "expert_shared_count": 1,
        "expert_weights_scale": 2.5, "expert_weights_norm": True, "expert_gating_func": 2,
        "expert_group_count": 2, "expert_group_used_count": 1, "rope.dimension_count": HD // 2}),
    Variant("arcee", "arcee", _arcee),
    Variant("apertus", "apertus", _apertus, global_keys=APERTUS_XIELU),
    Variant("phimoe", "phimoe", _phimoe, top=lambda r: _norm_biases(r) | {"output.bias": np.zeros(V)},
            keys=_MOE_KEYS | {"feed_forward_length": FX}),
    Variant("dbrx", "dbrx", _dbrx, keys=_MOE_KEYS | {
        "feed_forward_length": FX, "attention.clamp_kqv": 8.0, "attention.layer_norm_epsilon": 1e-5}),
    Variant("grok", "grok", _grok, keys=_MOE_KEYS | {
        "expert_feed_forward_length": FX, "embedding_scale": 3.0, "logit_scale": 0.6, "attention.output_scale": 0.25,
        "attn_logit_softcapping": 30.0, "router_logit_softcapping": 30.0, "final_logit_softcapping": 30.0}),
    # 12 layers: stages start at multiples of 4 (no RoPE where (il + 1) % 4 == 0, no key for it)
    Variant("smollm3", "smollm3", _llama, n_layer=12),
    Variant("afmoe", "afmoe", _afmoe, n_layer=12, keys=_MOE_KEYS | _SWA_KEYS | {
        "leading_dense_block_count": LEAD, "expert_feed_forward_length": FX, "expert_shared_count": 1,
        "expert_weights_scale": 2.5, "expert_weights_norm": True, "expert_gating_func": 2}),
    # ---- hybrid and recurrent families (issue 55)
    Variant("lfm2", "lfm2", _lfm2, out_norm="token_embd_norm.weight", keys={
        "shortconv.l_cache": LFM2_CONV, "attention.head_count_kv": [KV if _lfm2_attn(il) else 0 for il in range(6)]}),
    Variant("granitehybrid", "granitehybrid", _granitehybrid, keys=_GRANITE_HYBRID_KEYS),
    Variant("qwen3next", "qwen3next", _qwen3next, n_nextn=1, keys=_QWEN3NEXT_KEYS),
    Variant("qwen35", "qwen35", _qwen35, n_nextn=1, keys=_QWEN35_KEYS),
    Variant("qwen35moe", "qwen35moe", _qwen35moe, n_nextn=1, keys=_QWEN35_KEYS | _QWEN3NEXT_KEYS),
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
    for name, val in [(f"{v.arch}.{k}", val) for k, val in (keys | v.keys).items()] + list(v.global_keys.items()):
        if isinstance(val, list):  # per-layer values
            w.add_array(name, val)
        elif isinstance(val, bool):
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
    tensors = {"token_embd.weight": r.standard_normal((V, E)), v.out_norm: np.ones(E)}
    if v.tied:
        # logits are token_embd @ h: small embeddings let the layers, not the token's own row, set h's direction
        # (otherwise greedy decoding repeats its input), and a large output norm keeps the logits apart
        tensors["token_embd.weight"] *= 0.1
        tensors["output_norm.weight"] *= 10.0
    for il in range(v.n_layer + v.n_nextn):
        tensors |= {f"blk.{il}.{k}": a for k, a in v.layer(r, il, v.n_layer).items()}
    if v.top:
        tensors |= v.top(r)
    if not v.tied:
        tensors["output.weight"] = np.zeros((V, E))
        _write(path, v, tensors, qtype)
        tensors["output.weight"] = _codebook(path, v.n_layer, tensors[v.out_norm], seed, logit_scale)
    _write(path, v, tensors, qtype)
    return path
