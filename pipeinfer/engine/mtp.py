"""The target's own multi-token-prediction head (MTP, "nextn" layers): a draft that costs one layer, run by the last
stage, where the hidden state it needs is.

GLM-4.5 and later, DeepSeek V3, Qwen3-Next and Qwen3.5, MiMo and others carry trailing blocks trained to predict the
token after next. llama.cpp runs them in a context of their own (LLAMA_CONTEXT_TYPE_MTP) on a model loaded with
load_mtp (common/speculative.cpp, draft-mtp). Its rows are (token x_p at position p, the target's hidden state after
position p - 1: the last layer's output after the final norm, the graph's `result_norm`); the row after the last
verified position, (the target's next token t at q + 1, h_q), gives logits for position q + 2. The context keeps a KV
cache of its own over those rows, so every position is fed once (a row for a position fed again replaces what
followed it).

What the last stage loads is a file of its own (mtp_file): the source's key-values, the token embeddings, the final
norm, the output projection and the nextn block (blk.{n_layer}.*), which llama.cpp loads as the whole model's MTP part
(the trunk's tensors are optional to its loader when the first block's are absent). A stage file holds no nextn
block (stagefile.py).

Exactness does not rest on it: the target verifies every proposal. A row whose hidden state the last stage did not
compute (a prompt chunk's rows but its last: only output rows reach the final norm) goes in with zeros, as llama.cpp
feeds the first prompt token; that only makes its proposals agree less.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from .stagefile import model_part_path, read_info, write_model_part

MTP_FORMAT = 1
# architectures whose graph in the vendored llama.cpp has an MTP decoder (src/models/*.cpp: DECODER_MTP) fed the state
# after the final norm (step35's takes it before the norm: left out); tested here on synthetic glm4moe, deepseek2,
# qwen3next and qwen35moe models (tests/test_mtp.py)
MTP_ARCHS = frozenset({"glm4moe", "glm-dsa", "glm5-next", "deepseek2", "deepseek32", "deepseek4", "qwen3next", "qwen35",
                       "qwen35moe", "mimo2", "bailingmoe3", "cohere2moe", "hy_v3", "nemotron_h_moe"})
LLAMA_CONTEXT_TYPE_MTP = 1


def nextn_layers(path: str | os.PathLike) -> tuple[str, int]:
    """(architecture, trailing multi-token-prediction blocks) from a GGUF's header."""
    from .ggufheader import read_header
    fields = read_header(path).fields
    arch = str(fields.get("general.architecture", ""))
    return arch, int(fields.get(f"{arch}.nextn_predict_layers", 0) or 0)


def mtp_refusal(path: str | os.PathLike) -> str | None:
    """Why a target cannot draft with its own MTP head here, in one line; None when it can."""
    arch, n = nextn_layers(path)
    if n == 0:
        return f"{Path(path).name} has no multi-token-prediction layers ({arch}.nextn_predict_layers is absent or 0)"
    if arch not in MTP_ARCHS:
        return f"the llama.cpp built here has no MTP graph for {arch} (it has one for {', '.join(sorted(MTP_ARCHS))})"
    return None


def ensure_mtp_file(src: str | os.PathLike) -> Path:
    """The MTP part of src as a file of its own (see the module docstring), written on first use beside the stage
    files."""
    from ..core.files import write_atomically
    out = model_part_path(src, "mtp", MTP_FORMAT)
    if not out.exists():
        parts = ("token_embd.", "output_norm.", "output.", f"blk.{read_info(src).n_layer}.")  # n_layer: the trunk's
        write_atomically(out, lambda tmp: write_model_part(src, tmp, lambda name: name.startswith(parts)))
    return out


class MtpHead:
    """An MTP context on the MTP file. `propose` feeds rows and drafts one token in one decode."""

    def __init__(self, path: str | os.PathLike, *, n_ctx: int, n_batch: int, n_threads: int):
        import llama_cpp

        from .kernels import model_params
        from .stage import init_backend
        init_backend()
        mparams = model_params("repack")
        mparams.load_mtp = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load the MTP layers of {path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch + 1
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.ctx_type = LLAMA_CONTEXT_TYPE_MTP
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make an MTP context for {path}")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        n = n_batch + 1
        self._tok = np.zeros(n, np.int32)
        self._pos = np.zeros(n, np.int32)
        self._n_seq = np.ones(n, np.int32)
        self._seq = np.zeros((n, 1), np.int32)
        self._out = np.zeros(n, np.int8)
        self._embd = np.zeros((n, self.n_embd), np.float32)
        self._row_ptrs = (ctypes.POINTER(ctypes.c_int32) * n)(
            *[ctypes.cast(self._seq.ctypes.data + i * self._seq.strides[0], ctypes.POINTER(ctypes.c_int32))
              for i in range(n)])
        b = llama_cpp.llama_batch()
        b.token = self._tok.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))  # a row carries a token and a state
        b.embd = self._embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        b.pos = self._pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.n_seq_id = self._n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._row_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        b.logits = self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b
        self.n_decodes = 0

    def propose(self, tokens: np.ndarray, pos: np.ndarray, states: np.ndarray) -> tuple[int, float]:
        """Rows (tokens[i] at pos[i], the target's state after pos[i] - 1: states[i], f32[n_embd]), positions
        consecutive; the last row is the draft row: (the target's next token, its state after the last verified
        position). Returns the MTP's most likely token after it and its probability. What the context held from
        pos[0] on is dropped first."""
        import llama_cpp
        n = len(tokens)
        llama_cpp.llama_memory_seq_rm(self.mem, 0, int(pos[0]), -1)
        self._tok[:n], self._pos[:n], self._embd[:n] = tokens, pos, states
        self._out[:n] = 0
        self._out[n - 1] = 1
        self._batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, self._batch)
        if rc != 0:
            raise RuntimeError(f"MTP llama_decode returned {rc} ({n} rows at positions {pos[0]}..{pos[-1]})")
        self.n_decodes += 1
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, n - 1), (self.n_vocab,))
        best = int(np.argmax(logits))
        z = np.exp(logits - logits[best], dtype=np.float64).sum()
        return best, float(1.0 / z)

    def close(self) -> None:
        import llama_cpp
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


KEEP_STATES = 256  # positions behind the newest whose states the last stage keeps (a run starts at most a few
                  # positions behind it; all of them would be n_ctx x n_embd floats: 84 MB for GLM-4.5 at 4096 cells)


class MtpFeeder:
    """The last stage's side: the target's states by position (output rows only) and the MTP head fed run by run.
    One generation's sequence at a time (a run's rows are a chain of consecutive positions)."""

    def __init__(self, head: MtpHead):
        self.head = head
        self.states: dict[int, np.ndarray] = {}   # position -> the target's state after it (the newest KEEP_STATES)
        self.zero = np.zeros(head.n_embd, np.float32)

    def after_run(self, tokens: np.ndarray, pos: np.ndarray, output: np.ndarray, hidden: np.ndarray,
                  next_tokens: np.ndarray) -> tuple[int, int, float] | None:
        """A run's rows (tokens, positions, output flags), the states of its output rows (hidden: f32[n_out,
        n_embd], in row order) and the target's token after each output row: (position, token, probability) the
        MTP proposes after the run's last row and the target's token after it; None for a run that is not a chain
        ending in an output row."""
        n = len(tokens)
        if n == 0 or not output[-1] or not np.array_equal(pos, np.arange(pos[0], pos[0] + n)):
            return None
        p0 = int(pos[0])
        for p in [p for p in self.states if p >= p0 or p < p0 - KEEP_STATES]:
            del self.states[p]
        for row, state in zip(np.flatnonzero(output), hidden):
            self.states[int(pos[row])] = state
        q = int(pos[-1])
        rows_tok = np.append(tokens, next_tokens[-1]).astype(np.int32)
        rows_pos = np.arange(p0, q + 2, dtype=np.int32)
        rows_state = np.stack([self.states.get(p - 1, self.zero) for p in rows_pos])
        token, prob = self.head.propose(rows_tok, rows_pos, rows_state)
        return q + 2, token, prob

    def close(self) -> None:
        self.head.close()
