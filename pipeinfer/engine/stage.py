"""Stage engine: one llama.cpp model + context for one layer range of the target (or a whole draft model).

A stage decodes a batch given token ids (a whole-model stage) or float32 hidden states f32[n, n_embd]
(every stage of a split model: the head looks up the first stage's token embeddings itself), and
returns hidden states (non-final stage, captured from `l_out-{n_layer-1}` through `cb_eval`) or logits
(final stage, f32[n_outputs, n_vocab]). It also applies KV sequence operations and can abort a decode
midway through llama.cpp's abort callback.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from pathlib import Path
from typing import Callable

import llama_cpp
import numpy as np

from ..core.protocol import Batch, KvOp, RowRules, pack_logprobs
from ..core.verify import row_tokens, run_logprobs
from ..core.sampling import RunSampling
from .group_sums import PartialSums
from .kernels import DEFAULT_KERNELS, flash_attn_type, kv_cache_types, model_params

MTP_STATE_NAME = b"result_norm"  # the graph node an MTP head takes as its state: the last layer after the final norm

LLAMA_MAX_SEQ = 256  # llama.cpp's cap on n_seq_max


class DecodeAborted(Exception):
    """llama_decode returned 2: the abort callback stopped the graph."""


def _ggml_base():
    """ctypes handle on libggml-base.so shipped inside llama_cpp (tensor name / size / read)."""
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(next(lib_dir.glob("libggml-base.so*"))))
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_set.restype = None
    lib.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.name_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(("ggml_get_name", lib))  # where a name lies
    return lib


def name_key(name: bytes) -> tuple[int, int]:
    """(key, mask): a node's name field holds `name` (from 7 characters on: starts with its first 8 bytes) when its
    first 8 bytes, as a little-endian integer, & mask == key. A shorter name's mask covers the name and its NUL
    only: the field's bytes after the NUL are not defined."""
    n = min(len(name) + 1, 8)
    return int.from_bytes((name + b"\0")[:n], "little"), (1 << 8 * n) - 1


# Graphs that scale every input by sqrt(n_embd), hidden states included (models/gemma.cpp, gemma2.cpp; gemma3
# scales token input only), and the name of the scaled tensor: an engine fed hidden states writes them into
# that tensor as they came, after the graph computed it and before any layer reads it. (Dividing by sqrt(n_embd)
# first is not exact: not every float is a product of a float and 48.)
SCALES_EVERY_INPUT = {"gemma": b"inp_scaled", "gemma2": b"inp_scaled",
                      "afmoe": b"inp_embd_scaled"}  # models/afmoe.cpp: the MuP scaling, every input too

# Graphs that abort on hidden-state input (models/glm4.cpp, glm4-moe.cpp: `if (ubatch.embd && !use_mrope)
# GGML_ABORT(...)`, a file without M-RoPE sections), and the tensor their token input becomes: an engine fed hidden
# states decodes token 0 in every row and writes the hidden states into the looked-up rows (`embd`, what layer 0
# reads) after the graph computed them. RoPE, positions and the KV cache stay those of token input, the whole
# model's. (Writing M-RoPE sections instead would turn glm4's adjacent-pair RoPE into NeoX pairs.)
TOKEN_INPUT_ONLY = {"glm4": b"embd", "glm4moe": b"embd",
                    # M-RoPE (qwen35.cpp, qwen35moe.cpp): hidden-state input takes 4 positions a token
                    # (llama-batch.cpp:98), token input 1, expanded to the text positions (llama-graph.cpp:131);
                    # the graph renames `embd` (models/qwen35.cpp:147)
                    "qwen35": b"model.input_embed", "qwen35moe": b"model.input_embed"}


def model_arch(model) -> str:
    """general.architecture of a loaded llama.cpp model."""
    return _meta(model, "general.architecture") or ""


def _meta(model, key: str) -> str | None:
    """A metadata value of a loaded llama.cpp model, as text; None where the model has no such key."""
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode() if n >= 0 else None


def one_cache_type(model, arch: str) -> bool:
    """Whether llama.cpp needs this model's K and V caches of one type: its multi-head latent attention keeps V
    inside K's cells (llama-context.cpp: is_mla() or DeepSeek 4; key_length_mla in the file)."""
    return arch == "deepseek4" or _meta(model, f"{arch}.attention.key_length_mla") is not None


_GGML = None
_BACKEND_READY = False
_BACKEND_LOCK = threading.Lock()


def _ggml_dequantizer(type_name: str):
    """ggml's dequantize_row_<type>(src, dst f32, n) from libggml-base, or None if it has none."""
    global _GGML
    if _GGML is None:
        _GGML = _ggml_base()
    name = type_name.lower()
    if name.endswith("_k"):
        name = name[:-2] + "_K"  # ggml spells the k-quants q4_K, q6_K, ...
    fn = getattr(_GGML, f"dequantize_row_{name}", None)
    if fn is not None:
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return fn


_ABORTING = False  # an abort we asked for makes llama.cpp log errors that are not errors
_NO_ABORT = ctypes.cast(None, llama_cpp.ggml_abort_callback)  # no abort callback: llama.cpp polls nothing


def _quiet_log(level, text, user_data):  # llama.cpp logs to stderr by default; keep the CLI clean
    if os.environ.get("PIPEINFER_LLAMA_LOG") or (level == 4 and not _ABORTING):  # 4: GGML_LOG_LEVEL_ERROR
        os.write(2, text)


_LOG_CB = llama_cpp.llama_log_callback(_quiet_log)


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux's madvise advice (MADV_COLLAPSE: Linux 6.1 on)


def anonymous_regions() -> set[tuple[int, int]]:
    """(start, end) of this process's private anonymous read-write mappings (empty without /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    regions = set()
    for line in lines:
        fields = line.split()  # address perms offset dev inode [path]: anonymous ones have no path
        if len(fields) == 5 and fields[1].startswith("rw") and fields[4] == "0":
            start, end = (int(x, 16) for x in fields[0].split("-"))
            regions.add((start, end))
    return regions


def advise_huge_pages(regions: set[tuple[int, int]], collapse: bool) -> int:
    """madvise(MADV_HUGEPAGE) on the whole 2 MiB pages of these regions (pages that fault in from then on come
    as huge pages), and with `collapse` MADV_COLLAPSE page by page on what is already there (a page that
    cannot be collapsed keeps its small pages). Returns the bytes in huge pages after collapsing (0 without)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    huge = 0
    for start, end in regions:
        lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if hi <= lo or libc.madvise(lo, hi - lo, MADV_HUGEPAGE) != 0 or not collapse:
            continue
        for page in range(lo, hi, HUGE_PAGE):
            huge += HUGE_PAGE if libc.madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0 else 0
    return huge


class WeightPages:
    """A model's weights in huge pages. A decode streams every weight once, and in 4 KiB pages it misses the TLB
    all along: with the weights in 2 MiB pages a half-Qwen2.5-1.5B stage decoded 12-13% faster on this project's
    machine (18.6 instead of 21.2 ms, 25.7 instead of 29.7; launch/bench/bench_overhead.py), and loaded 0.8 s slower.
    llama.cpp then reads the file into memory of its own
    (LLAMA_LOAD_MODE_NONE: no file mapping, which the kernel would keep in small pages); when the first tensor
    is about to be read in, its buffers exist and are still empty, so they are advised to fault in as huge
    pages; after the load whatever did not is collapsed. The bytes, and so every result, are unchanged.
    Linux only (MADV_COLLAPSE from 6.1); PIPEINFER_HUGE_PAGES=0 keeps llama.cpp's file mapping instead."""

    def __init__(self, mparams):
        self.wanted = os.environ.get("PIPEINFER_HUGE_PAGES", "1") != "0" and os.path.exists("/proc/self/maps")
        self.bytes = 0  # the weights' bytes in huge pages after the load
        if not self.wanted:
            return
        mparams.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
        self._before = anonymous_regions()
        self._advised = False
        self._callback = llama_cpp.llama_progress_callback(self._on_progress)
        mparams.progress_callback = self._callback

    def _on_progress(self, progress, user_data) -> bool:
        if not self._advised:
            self._advised = True
            try:
                advise_huge_pages(anonymous_regions() - self._before, collapse=False)
            except Exception:  # noqa: BLE001 - advice only; an exception here would make llama.cpp stop loading
                pass
        return True  # go on loading

    def loaded(self) -> None:
        if self.wanted:
            self.bytes = advise_huge_pages(anonymous_regions() - self._before, collapse=True)


def init_backend() -> None:
    """llama.cpp's backend and log callback, once per process (rank 0's tokenizer loads in a thread of its own)."""
    global _BACKEND_READY
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            llama_cpp.llama_log_set(_LOG_CB, None)
            llama_cpp.llama_backend_init()
            _BACKEND_READY = True


def draw_tokens(logits: np.ndarray, batch: Batch, sampling: RunSampling, rules: RowRules | None):
    """(the token after each output row i32[n_outputs], the LOGPROBS payload or None) of a final stage's logits
    f32[n_outputs, n_vocab] (StageEngine.decode_tokens)."""
    tokens = row_tokens(logits, batch.output_pos, sampling, rules)
    logprobs = run_logprobs(logits, tokens, sampling)
    return tokens, None if logprobs is None else pack_logprobs(*logprobs)


class StageEngine:
    """Owns llama.cpp state for layers of one stage. `embd_input`: feed hidden states instead of tokens."""

    def __init__(self, path: str | os.PathLike, *, n_ctx: int, n_batch: int, n_seq_max: int,
                 n_threads: int, n_threads_batch: int, embd_input: bool, capture_hidden: bool,
                 kernels: str = DEFAULT_KERNELS, capture_states: bool = False, sums: PartialSums | None = None):
        global _GGML
        init_backend()
        if n_seq_max > LLAMA_MAX_SEQ:
            raise ValueError(f"n_seq_max {n_seq_max} exceeds llama.cpp's cap of {LLAMA_MAX_SEQ}")
        self._stack = contextlib.ExitStack()
        mparams = model_params(kernels)
        pages = WeightPages(mparams)
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self._stack.callback(llama_cpp.llama_model_free, self.model)
        pages.loaded()
        self.huge_page_bytes = pages.bytes
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        self.n_layer = llama_cpp.llama_model_n_layer(self.model)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.kernels = kernels
        self.n_threads = n_threads
        self.embd_input = embd_input
        self.capture_hidden = capture_hidden
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        # llama.cpp keeps a recurrent state per sequence (core/recurrent.py): partial removals fail, seq_cp copies states
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(self.model)
                              or llama_cpp.llama_model_is_hybrid(self.model))

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch  # one ubatch per decode: captured rows stay in batch order
        cparams.n_seq_max = n_seq_max
        # llama.cpp sizes its output buffer for max(outputs, n_seq_max) rows and asserts that fits n_outputs_max
        # (n_batch by default): a small -b with many sequences (serve's lanes) aborted the process
        cparams.n_outputs_max = max(n_batch, n_seq_max)
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads_batch
        cparams.kv_unified = True  # sequences share one cell pool; seq_cp only tags cells
        cparams.no_perf = True
        cparams.flash_attn_type = flash_attn_type(kernels)  # kernels.py: which settings are batch-invariant
        arch = model_arch(self.model)
        cparams.type_k, cparams.type_v = kv_cache_types(kernels, one_type=one_cache_type(self.model, arch))
        self._captured: list[np.ndarray] = []
        # a non-final stage captures its last layer's output; a final stage feeding the MTP head (mtp.py) the states
        self._capture_name = (f"l_out-{self.n_layer - 1}".encode() if capture_hidden else
                              MTP_STATE_NAME if capture_states else None)
        self._input_name = (SCALES_EVERY_INPUT.get(arch) or TOKEN_INPUT_ONLY.get(arch)) if embd_input else None
        self._token_carrier = embd_input and arch in TOKEN_INPUT_ONLY  # hidden states ride on token 0's rows
        self._input_rows = 0  # rows written into the input tensor by the last decode
        self.sums = sums  # a tensor group member's partial sums, added to the others' mid-graph (group_sums.py)
        if self._capture_name or self._input_name or sums:
            if _GGML is None:
                _GGML = _ggml_base()
            self._cb_eval = llama_cpp.ggml_backend_sched_eval_callback(self._node_filter())
            cparams.cb_eval = self._cb_eval
            cparams.cb_eval_user_data = None
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max})")
        self._stack.callback(llama_cpp.llama_free, self.ctx)
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.should_abort: Callable[[], bool] | None = None  # polled by llama.cpp during a decode
        self._abort_cb = llama_cpp.ggml_abort_callback(self._on_abort_poll)
        self._abort_polled = False  # whether llama.cpp calls _on_abort_poll (see _decode)
        self._alloc_batch(n_batch)

    # ---- batch buffers: numpy arrays the llama_batch points into (filled without per-token ctypes calls)
    def _alloc_batch(self, n_max: int) -> None:
        self._tok = np.zeros(n_max, dtype=np.int32)
        self._pos = np.zeros(n_max, dtype=np.int32)
        self._n_seq = np.zeros(n_max, dtype=np.int32)
        self._out = np.zeros(n_max, dtype=np.int8)
        self._seq = np.zeros((n_max, self.n_seq_max), dtype=np.int32)  # row i: seq ids of token i
        self._embd = np.zeros((n_max, self.n_embd), dtype=np.float32) if self.embd_input else None
        row_ptrs = (ctypes.POINTER(ctypes.c_int32) * n_max)(
            *[ctypes.cast(self._seq.ctypes.data + i * self._seq.strides[0], ctypes.POINTER(ctypes.c_int32))
              for i in range(n_max)])
        self._row_ptrs = row_ptrs
        b = llama_cpp.llama_batch()
        embd_batch = self.embd_input and not self._token_carrier  # a carrier's token ids stay 0
        b.token = None if embd_batch else self._tok.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.embd = self._embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if embd_batch else None
        b.pos = self._pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.n_seq_id = self._n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(row_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        b.logits = self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b

    def _node_filter(self):
        """The cb_eval callback. llama.cpp asks it about every node of the graph (482 times per decode of 14
        Qwen2 layers), so it answers most nodes from the first 8 bytes of their name field, read in place, and
        hands only the nodes whose name starts like a hooked one to _on_tensor (asking ggml for each name took
        0.47 us a node, this takes 0.16). The capture then costs a half-Qwen2.5-1.5B decode 0.26 ms instead of
        0.39 (launch/bench/bench_overhead.py)."""
        keys = [name_key(n) for n in (self._capture_name, self._input_name) if n]
        (key_a, mask_a), (key_b, mask_b) = (keys + [(-1, 0), (-1, 0)])[:2]  # (-1, 0): no such hooked name
        more = [name_key(n) for n in self.sums.PREFIXES] if self.sums else []  # a group member's partial sums
        read_u64, name_address, on_tensor = ctypes.c_uint64.from_address, _GGML.name_address, self._on_tensor
        name_offset: list[int] = []  # where ggml_tensor.name lies in the struct, learned from the first node

        def on_node(tensor, ask, user_data) -> bool:
            if not name_offset:
                name_offset.append(name_address(tensor) - tensor)
            prefix = read_u64(tensor + name_offset[0]).value
            if prefix & mask_a != key_a and prefix & mask_b != key_b:
                if more and any(prefix & mask == key for key, mask in more):
                    return self.sums.on_node(tensor, ask, _GGML)
                return not ask  # ask: not needed; a node it did not ask for: go on
            return on_tensor(tensor, ask, user_data)
        return on_node

    def _on_tensor(self, tensor, ask, user_data) -> bool:
        name = _GGML.ggml_get_name(tensor)
        if name != self._capture_name and name != self._input_name:
            return False if ask else True
        if ask:
            return True
        nbytes = _GGML.ggml_nbytes(tensor)
        if name == self._input_name:
            # the graph multiplied the hidden states by sqrt(n_embd), or looked up token 0: give layer 0 the rows
            # as they came; a decode of several ubatches (a hybrid's nested sequences: one token each) gets them
            # ubatch by ubatch, in batch order as the captured rows
            at = self._input_rows
            self._input_rows = at + nbytes // (4 * self.n_embd)
            if self._input_rows <= len(self._embd):
                _GGML.ggml_backend_tensor_set(tensor, self._embd[at:].ctypes.data, 0, nbytes)
            return True
        rows = np.empty(nbytes // 4, dtype=np.float32)
        _GGML.ggml_backend_tensor_get(tensor, rows.ctypes.data, 0, nbytes)
        self._captured.append(rows.reshape(-1, self.n_embd))
        return True

    def _on_abort_poll(self, data) -> bool:
        global _ABORTING
        if self.should_abort is not None and self.should_abort():
            _ABORTING = True
            return True
        return False

    # ---- decoding
    def decode(self, batch: Batch, embd: np.ndarray | None = None) -> np.ndarray:
        """Hidden states f32[n, n_embd] (non-final stage) or logits f32[n_outputs, n_vocab] (final stage)."""
        self._decode(batch, embd)
        if self.capture_hidden:
            return self.captured(batch.n_tokens)
        return self._logits(batch.n_tokens).copy()

    def decode_tokens(self, batch: Batch, embd: np.ndarray | None, sampling: RunSampling,
                      rules: RowRules | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """A final stage's token after each output row, i32[n_outputs] (verify.row_tokens, after the run's rules,
        each row by its group's sampling), read from llama.cpp's own logits buffer (the vocabulary-sized rows are
        copied only to apply rules); when a group asks top_logprobs, the LOGPROBS payload i32[n_outputs, 1 + 2k]
        beside them, k the widest asked (verify.run_logprobs; else None)."""
        self._decode(batch, embd)
        return draw_tokens(self._logits(batch.n_tokens), batch, sampling, rules)

    def captured(self, n: int) -> np.ndarray:
        """The last decode's captured rows, f32[n, n_embd] in row order: a non-final stage's hidden states (every
        row), or with capture_states a final stage's output rows after the final norm (the MTP head's states)."""
        hidden = np.concatenate(self._captured) if len(self._captured) > 1 else self._captured[0]
        if hidden.shape != (n, self.n_embd):
            raise RuntimeError(f"captured hidden states {hidden.shape}, expected {(n, self.n_embd)}")
        return hidden

    def _logits(self, n: int) -> np.ndarray:
        """The last decode's logits, f32[n_outputs, n_vocab]: a view of llama.cpp's buffer, valid until the next decode."""
        n_out = int(np.count_nonzero(self._out[:n]))
        if n_out == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab))

    def _decode(self, batch: Batch, embd: np.ndarray | None) -> None:
        """Run llama_decode on the batch (DecodeAborted when the abort callback stopped it)."""
        n = batch.n_tokens
        if n < 1 or n > self.n_batch:
            raise ValueError(f"batch of {n} tokens outside 1..{self.n_batch}")
        if self.embd_input:
            if embd is None or embd.shape != (n, self.n_embd):
                raise ValueError(f"expected hidden states f32[{n}, {self.n_embd}], got "
                                 f"{None if embd is None else embd.shape}")
            self._embd[:n] = embd
        else:
            self._tok[:n] = batch.tokens
        self._pos[:n] = batch.pos
        for i, ids in enumerate(batch.seq_ids):
            self._n_seq[i] = len(ids)
            self._seq[i, :len(ids)] = ids
        # every row is an output on a capturing stage: llama.cpp keeps only output rows in the last layer
        self._out[:n] = 1 if self.capture_hidden else batch.output
        self._batch.n_tokens = n
        self._captured.clear()
        self._input_rows = 0
        if (self.should_abort is not None) != self._abort_polled:
            # llama.cpp calls the abort callback into Python after most graph nodes (284 times per decode of 14
            # Qwen2 layers): only while a decode may be cancelled
            self._abort_polled = not self._abort_polled
            llama_cpp.llama_set_abort_callback(self.ctx, self._abort_cb if self._abort_polled else _NO_ABORT, None)
        global _ABORTING
        try:
            rc = llama_cpp.llama_decode(self.ctx, self._batch)
        finally:
            _ABORTING = False
        if rc == 2:
            # llama.cpp frees an aborted batch's cells by each token's first sequence only, so a tree cell
            # shared by branches survives; free all of them: they are the latest cells, and the next
            # batch must take their place, above every older cell (kvplan.py: cells stay in order). With recurrent
            # layers the removal fails (a state cannot drop tokens) and changes nothing: the aborted run's cells are
            # retired with its partition instead (core/recurrent.py)
            first: dict[int, int] = {}
            for p, ids in zip(batch.pos.tolist(), batch.seq_ids):
                for s in ids:
                    first[s] = min(first.get(s, p), p)
            for s, p in first.items():
                llama_cpp.llama_memory_seq_rm(self.mem, s, p, -1)
            raise DecodeAborted()
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (batch of {n} tokens at positions "
                               f"{int(batch.pos.min())}..{int(batch.pos.max())})")
        if self._input_name and self._input_rows != n:
            raise RuntimeError(f"{self._input_name.decode()}: {self._input_rows} rows in the graph, {n} given")

    # ---- KV sequences
    def apply_kv_ops(self, ops: np.ndarray) -> None:
        """ops: i32[k, 5] rows (KvOp, seq_src, seq_dst, p0, p1), applied in order; consecutive COMPACT rows
        are one compaction that keeps every sequence they name."""
        rows = np.asarray(ops).reshape(-1, 5).tolist()
        i = 0
        while i < len(rows):
            op, src, dst, p0, p1 = rows[i]
            i += 1
            if op == KvOp.RM:
                if src < 0 and self.recurrent and p0 <= 0 and p1 < 0:
                    llama_cpp.llama_memory_clear(self.mem, False)  # recurrent memory refuses sequence id -1
                elif not llama_cpp.llama_memory_seq_rm(self.mem, src, p0, p1):
                    raise RuntimeError(f"seq_rm({src}, {p0}, {p1}) failed")
            elif op == KvOp.CP:
                llama_cpp.llama_memory_seq_cp(self.mem, src, dst, p0, p1)
            elif op == KvOp.KEEP:
                llama_cpp.llama_memory_seq_keep(self.mem, src)
            elif op == KvOp.COMPACT:
                keep = [src]
                while i < len(rows) and rows[i][0] == KvOp.COMPACT:
                    keep.append(rows[i][1])
                    i += 1
                self._compact(keep)
            else:
                raise ValueError(f"unknown KV op {op}")

    def _compact(self, seqs: list[int]) -> None:
        """Keep only `seqs`, each repacked in the order it held its cells, one after another from cell 0
        (kvplan.py: garbage). llama.cpp writes a sequence's cells in cell order and restores them into the
        first free cells, so each sequence's K/V bytes and order are unchanged and the holes are gone."""
        saved = []
        for seq in seqs:
            n = llama_cpp.llama_state_seq_get_size(self.ctx, seq)
            buf = (ctypes.c_uint8 * n)()
            got = llama_cpp.llama_state_seq_get_data(self.ctx, buf, n, seq)
            if got != n:
                raise RuntimeError(f"KV compaction of sequence {seq} failed ({got} of {n} bytes)")
            saved.append((seq, buf, got))
        llama_cpp.llama_memory_clear(self.mem, False)
        for seq, buf, n in saved:
            if llama_cpp.llama_state_seq_set_data(self.ctx, buf, n, seq) != n:
                raise RuntimeError(f"KV compaction of sequence {seq} failed (restoring {n} bytes)")

    def clear_kv(self) -> None:
        """Forget every cell (the next one goes to cell 0)."""
        llama_cpp.llama_memory_clear(self.mem, True)

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        """(min, max) position held by a sequence, (-1, -1) when empty."""
        return (llama_cpp.llama_memory_seq_pos_min(self.mem, seq), llama_cpp.llama_memory_seq_pos_max(self.mem, seq))

    def kv_summary(self, exclude: int | None = None) -> list[list[int]]:
        """[seq, min pos, max pos] for every non-empty sequence but `exclude`, for checks after a generation."""
        out = []
        for s in range(self.n_seq_max):
            if s == exclude:
                continue
            lo, hi = self.seq_pos_range(s)
            if hi >= 0:
                out.append([s, lo, hi])
        return out

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TokenEmbedder:
    """Looks up token_embd rows (dequantized): the first stage's hidden-state input on the head, and the input
    of a draft model whose output head is pruned (ModelDrafter)."""

    # architectures whose graph scales *token* inputs by sqrt(n_embd) (but not embedding inputs)
    SCALED = {"gemma", "gemma2", "gemma3", "afmoe"}

    def __init__(self, path: str | os.PathLike):
        import gguf

        from .ggufheader import read_header, tensor_rows
        header = read_header(path)
        arch = header.fields["general.architecture"]
        info = header.tensors["token_embd.weight"]
        self._rows = tensor_rows(path, info)  # uint8[n_vocab, bytes per row], memory-mapped
        self._type = gguf.GGMLQuantizationType(info.ggml_type)
        self.n_embd, self.n_vocab = int(info.shape[0]), int(info.shape[1])
        self.scale = math.sqrt(self.n_embd) if arch in self.SCALED else 1.0
        self._dequantize = gguf.quants.dequantize
        self._c_dequantize = _ggml_dequantizer(self._type.name)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        """f32[n_tokens, n_embd] input rows of the first stage, bit-identical to llama.cpp's own lookup."""
        raw = np.ascontiguousarray(self._rows[np.asarray(tokens)])
        if self._type == self._type.F32:
            rows = raw.view(np.float32)
        elif self._type == self._type.F16:
            rows = raw.view(np.float16).astype(np.float32)
        elif self._c_dequantize is not None:
            # ggml's own dequantizer: numpy's reimplementation (gguf.quants) can differ in the last bit,
            # enough to change a near-tie token 56 tokens later on Qwen2.5-Coder-1.5B
            rows = np.empty((len(tokens), self.n_embd), dtype=np.float32)
            self._c_dequantize(raw.ctypes.data, rows.ctypes.data, rows.size)
        else:
            rows = self._dequantize(raw, self._type)
        rows = np.asarray(rows, dtype=np.float32).reshape(len(tokens), self.n_embd)
        return rows * np.float32(self.scale) if self.scale != 1.0 else rows
