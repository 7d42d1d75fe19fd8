"""Small synthetic llama-architecture GGUF models for tests (numpy + gguf.GGUFWriter only).

Design (why greedy outputs here are robust to float noise):
  * token t -> embedding E[t]; pre-norm llama blocks with deliberately weak attention and strong FFNs
    turn it into a final hidden state h(t, context).
  * output.weight is a *codebook*: row succ(t) is the unit vector of the context-free final hidden
    state of token t (computed here in numpy by running each token alone), with the direction shared
    by all tokens projected out. succ() is one random cycle over the normal (non-special) tokens.
  * So greedy decoding follows t -> succ(t) (128 distinct tokens in 128 steps), with top1-top2 gaps
    of ~2 logit standard deviations; the hidden state must come through every layer to match the
    codebook (numpy check, default model: dropping layer 0 flips 26% of the greedy tokens, and
    dropping any layer moves logits by >= 8), while context (attention, positions, KV cache) moves
    logits by ~2.5 without flipping the argmax.
  * Caveat for tests: a stage that loses context (wrong positions, missing KV) can still produce the
    same greedy tokens; compare logits as well (`reference_run`), not only tokens.
Measured (llama-cpp-python 0.3.36, PROMPT_TOKENS, 128 greedy steps, logit_scale=4, logit sd ~4.5):
  min top1-top2 margin: n_layer=4 -> 11.0 (seeds 1,2: 7.4, 10.0), n_layer=6 -> 9.3 (seeds 1-3: 2.7-10.7);
  prompt as one batch vs token by token: identical tokens, max |dlogit| 1e-4 (f32/f16 KV), 6e-3 (f16
  weights), 0 (q8_0). n_embd=32 gives smaller margins (~0.5): prefer n_embd >= 64, and assert margins().
Building a model takes ~0.03 s; loading it + 128 greedy steps 0.03-0.1 s (1 thread).
"""
from __future__ import annotations

import pathlib

import numpy as np
import gguf

PROMPT_TOKENS = [1, 5, 9, 13, 22, 37, 41]  # starts with bos=1

# perturb value giving roughly {0.9, 0.6, 0.3} greedy agreement of the draft with its target (seed=0,
# PROMPT_TOKENS, 128 target tokens; f32 and q8_0 alike). Measured over perturb_seed 1..4 (spread shown):
#   n_layer=4: 0.35 -> 0.84-0.90   0.45 -> 0.59-0.64   0.55 -> 0.31-0.36   (0.25 -> 1.0, 0.8 -> 0.07)
#   n_layer=6: 0.27 -> 0.86-0.92   0.39 -> 0.54-0.65   0.48 -> 0.26-0.33
# Other shapes/seeds differ: measure with `agreement()`.
PERTURB_FOR_AGREEMENT = {4: {0.9: 0.35, 0.6: 0.45, 0.3: 0.55}, 6: {0.9: 0.27, 0.6: 0.39, 0.3: 0.48}}

_EPS = 1e-5
N_SPECIAL = 3  # <unk>, <s>, </s>


def _rms(x, eps=_EPS):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _context_free_hidden(W, n_layer, n_head, n_head_kv, n_vocab):
    """Final normed hidden state [n_vocab, n_embd] of each token decoded alone (attention = own v)."""
    x = W["token_embd.weight"].copy()
    rep = n_head // n_head_kv
    for il in range(n_layer):
        p = f"blk.{il}."
        a = _rms(x) * W[p + "attn_norm.weight"]
        v = a @ W[p + "attn_v.weight"].T                                 # [V, n_head_kv*hd]
        v = np.repeat(v.reshape(n_vocab, n_head_kv, -1), rep, axis=1)   # GQA: head h uses kv head h//rep
        x = x + v.reshape(n_vocab, -1) @ W[p + "attn_output.weight"].T
        f = _rms(x) * W[p + "ffn_norm.weight"]
        g, u = f @ W[p + "ffn_gate.weight"].T, f @ W[p + "ffn_up.weight"].T    # [V, n_ff]
        x = x + (g / (1.0 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    return _rms(x) * W["output_norm.weight"]


def _weights(n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, seed, logit_scale):
    """float64 weights in numpy layout [rows=out, cols=in]; GGUF ne is the reverse (ne0 = in)."""
    assert n_embd % n_head == 0 and n_head % n_head_kv == 0 and n_vocab > N_SPECIAL + 1
    rng = np.random.default_rng(seed)
    hd = n_embd // n_head
    # weak attention, strong FFN (see module doc); both shrink with depth to keep margins for deep stacks
    g_attn, g_ffn = 0.3 / np.sqrt(n_layer), 1.5 * min(1.0, np.sqrt(6 / n_layer))
    W = {"token_embd.weight": rng.standard_normal((n_vocab, n_embd))}              # ne {n_embd, n_vocab}
    for il in range(n_layer):
        p, r = f"blk.{il}.", rng.standard_normal
        W[p + "attn_norm.weight"] = np.ones(n_embd)                                    # {n_embd}
        W[p + "attn_q.weight"] = r((n_head * hd, n_embd)) / np.sqrt(n_embd)            # {n_embd, n_head*hd}
        W[p + "attn_k.weight"] = r((n_head_kv * hd, n_embd)) / np.sqrt(n_embd)         # {n_embd, n_head_kv*hd}
        W[p + "attn_v.weight"] = r((n_head_kv * hd, n_embd)) / np.sqrt(n_embd)         # {n_embd, n_head_kv*hd}
        W[p + "attn_output.weight"] = r((n_embd, n_head * hd)) * g_attn / np.sqrt(n_head * hd)  # {n_head*hd, n_embd}
        W[p + "ffn_norm.weight"] = np.ones(n_embd)                                     # {n_embd}
        W[p + "ffn_gate.weight"] = r((n_ff, n_embd)) / np.sqrt(n_embd)                 # {n_embd, n_ff}
        W[p + "ffn_up.weight"] = r((n_ff, n_embd)) / np.sqrt(n_embd)                   # {n_embd, n_ff}
        W[p + "ffn_down.weight"] = r((n_embd, n_ff)) * g_ffn / np.sqrt(n_ff)           # {n_ff, n_embd}
    W["output_norm.weight"] = np.ones(n_embd)                                          # {n_embd}
    # successor cycle over the normal tokens; specials get zero output rows (never predicted)
    perm = N_SPECIAL + rng.permutation(n_vocab - N_SPECIAL)
    succ = np.zeros(n_vocab, dtype=np.int64)
    succ[perm] = np.roll(perm, -1)
    H = _context_free_hidden(W, n_layer, n_head, n_head_kv, n_vocab)[N_SPECIAL:]
    m = H.mean(0) / np.linalg.norm(H.mean(0))
    Y = H - np.outer(H @ m, m)                        # drop the direction shared by all tokens
    out = np.zeros((n_vocab, n_embd))
    out[succ[N_SPECIAL:]] = Y / np.linalg.norm(Y, axis=1, keepdims=True)
    W["output.weight"] = out * logit_scale                                             # {n_embd, n_vocab}
    return W, succ


def add_vocab(w, n_vocab: int) -> None:
    """A SentencePiece-style ("llama") tokenizer of n_vocab pieces (_vocab), <unk> <s> </s> first, no BOS added."""
    toks, types = _vocab(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * N_SPECIAL + [-float(i) for i in range(N_SPECIAL, n_vocab)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


def _vocab(n_vocab):
    """SentencePiece-style pieces: <unk> <s> </s>, then unique CV-syllable words like '▁bafe', 'ki'."""
    cons, vows = "bdfgklmnprstvz", "aeiou"
    toks, types = ["<unk>", "<s>", "</s>"], [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL,
                                            gguf.TokenType.CONTROL]
    for i in range(N_SPECIAL, n_vocab):
        j, s = i, ""
        while True:  # base-70 digits of i as syllables -> unique per i
            s += cons[j % 14] + vows[j // 14 % 5]
            j //= 70
            if j == 0:
                break
        toks.append("\u2581" + s if i % 3 else s)   # 2 of 3 pieces start a word
        types.append(gguf.TokenType.NORMAL)
    if n_vocab >= 512:  # byte fallback in the last 256 ids, so any text tokenizes (CLI tests)
        for b in range(256):
            toks[n_vocab - 256 + b], types[n_vocab - 256 + b] = f"<0x{b:02X}>", gguf.TokenType.BYTE
    assert len(set(toks)) == n_vocab
    return toks, types


def make_llama_gguf(path, *, n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=512,
                    n_ctx_train=2048, seed=0, qtype="f32", perturb=0.0, perturb_seed=1,
                    logit_scale=4.0) -> pathlib.Path:
    """Write a synthetic llama GGUF. qtype: "f32" | "f16" | "q8_0" (2-D matrices only; norms stay f32).
    perturb > 0: every 2-D matrix w becomes w + perturb * std(w) * N(0,1) noise from perturb_seed
    (a draft model for the unperturbed target with the same seed; see PERTURB_FOR_AGREEMENT)."""
    path = pathlib.Path(path)
    if qtype == "q8_0":  # Q8_0 blocks are 32 values along each row (ne0)
        assert n_embd % 32 == 0 and n_ff % 32 == 0, "q8_0 needs n_embd and n_ff multiples of 32"
    W, _ = _weights(n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, seed, logit_scale)
    if perturb:
        rng = np.random.default_rng(perturb_seed)
        for k, w in W.items():
            if w.ndim == 2:
                W[k] = w + perturb * w.std() * rng.standard_normal(w.shape)
    qt = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
          "q8_0": gguf.GGMLQuantizationType.Q8_0}[qtype]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synth-llama-L{n_layer}-E{n_embd}-s{seed}-p{perturb}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(_EPS)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(ftype)
    add_vocab(w, n_vocab)
    w.add_add_eos_token(False)
    for name, arr in W.items():
        arr = arr.astype(np.float32)
        if arr.ndim == 2 and qt == gguf.GGMLQuantizationType.Q8_0:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        elif arr.ndim == 2 and qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_run(path, prompt_tokens, n_predict, n_threads=1, n_batch=512):
    """Greedy decode with llama_cpp: returns (tokens [n_predict], logits [n_predict, n_vocab] float32),
    logits[i] being the distribution that chose tokens[i]. n_batch=1 evaluates the prompt token by token."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt_tokens) + n_predict + 16,
                          n_threads=n_threads, n_threads_batch=n_threads, n_batch=n_batch,
                          logits_all=False, verbose=False)
    try:
        n_vocab, toks, logits = llm.n_vocab(), [], []
        llm.eval(list(prompt_tokens))
        for _ in range(n_predict):
            ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            logits.append(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy())
            toks.append(int(np.argmax(logits[-1])))
            llm.eval([toks[-1]])
        return toks, np.array(logits)
    finally:
        llm.close()


def reference_greedy(path, prompt_tokens, n_predict, n_threads=1) -> list[int]:
    return reference_run(path, prompt_tokens, n_predict, n_threads)[0]


def margins(path, prompt_tokens, n_predict, n_threads=1) -> np.ndarray:
    """top1 - top2 logit gap at each generated step of the reference run."""
    s = np.sort(reference_run(path, prompt_tokens, n_predict, n_threads)[1], axis=1)
    return s[:, -1] - s[:, -2]


def agreement(target_path, draft_path, prompt_tokens, n_predict, n_threads=1) -> float:
    """Fraction of positions where the draft's argmax, fed the target's greedy context, equals the target's."""
    import llama_cpp
    target = reference_greedy(target_path, prompt_tokens, n_predict, n_threads)
    seq = list(prompt_tokens) + target[:-1]
    llm = llama_cpp.Llama(model_path=str(draft_path), n_ctx=len(seq) + 16, n_threads=n_threads,
                          n_threads_batch=n_threads, n_batch=len(seq), logits_all=True, verbose=False)
    try:
        llm.eval(seq)
        pred = np.argmax(llm.scores[len(prompt_tokens) - 1:len(seq)], axis=1)
    finally:
        llm.close()
    return float(np.mean(pred == np.array(target)))


def quantize_gguf(src, dst, ftype: str = "q4_k_m") -> pathlib.Path:
    """`src` quantized by llama.cpp's own quantizer (llama_model_quantize) into `dst`: K-quant weights, whose matrix
    multiplies go row by row (one-row kernel, repacked gemv/gemm, tiled kernel) where f32 and q8_0 ones go through
    llamafile's sgemm from 2 rows on, so batched rows of a synthetic model can keep their bits. Rows of 256 values:
    n_embd and n_ff multiples of 256."""
    import ctypes

    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K}[ftype]
    params.nthread = 1
    dst = pathlib.Path(dst)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src}")
    return dst
