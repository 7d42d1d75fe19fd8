"""Kernel settings and the exact batch limit: how many rows a decode may carry and still give each row
bit-for-bit the output it gets when decoded alone, whether the rows are consecutive tokens of one sequence (a
micro-batch of drafts) or the next tokens of as many sequences (users served in one decode, decide/actions.py).

Verification decodes micro-batches of drafted tokens while the target alone decodes one token at a
time, so greedy output is exact only where both give identical logits. Which batch sizes do depends on
the weights' layout, the attention kernel, the quantization, the CPU's SIMD kernels and the build
(measured on Qwen2.5-Coder-1.5B Q4_K_M, llama-cpp-python 0.3.36, 1 thread; one-token decode on a host where
the repacked gemv pays, and on an AVX2 host where it does not, launch/bench/bench_kernels.py):

| `--kernels` | weights | attention | exact batches | one-token decode, 1 thread |
|---|---|---|---|---|
| `repack` (default) | repacked (llama.cpp's CPU "extra buffer") | flash | 1-3 | 50.9 ms / 90 ms |
| `no-repack` | as stored | flash | 1-7 | 75.9 ms / 85 ms |
| `tiled` | as stored, every K-quant multiply tiled | flash | 1-32 | 248 ms (16 rows: 292 ms) |
| `fast` | repacked | llama.cpp's default (off) | 1 | 61 ms / 85 ms |

`tiled` sends every K-quant matrix multiply, one row or 256, through ggml's tiled kernel (GGML_CPU_TILED_MM_FORCE,
process-wide; a draft in the same process keeps repacked weights, which never reach it), which llama.cpp itself takes
from 8 rows on: each output is a row's own dot products summed block after block whatever the tile's other rows, so
a row's bits do not depend on its batch, and unpacking the weights once serves every row of the tile. One row costs
6.5x a repacked row; 16 rows cost 1.2x one (AMD EPYC, 1 thread, the whole 1.5B).

The repacked gemm takes rows in blocks of 4 (rows outside a block go through the one-row gemv), and
from 8 rows on ggml multiplies K-quants with its tiled kernel; non-flash attention runs f16 matmuls
through llamafile's sgemm from 2 rows on. None of that is assumed here: `exact_batch_limit` measures the
limit of an engine when it loads and caches it beside the stage files. Rows of different sequences measured the
same limits as one sequence's on Qwen2.5-Coder-1.5B Q4_K_M on a 2-core AMD EPYC (repack 1-3, no-repack 1-7, 2 to
64 rows tried: docs/benchmarks.md); on an Intel Xeon no-repack kept only 1-5 across sequences: the probe checks both.
"""
from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache

import numpy as np

from ..core.config import DEFAULT_DRAFT_MAX, DEFAULT_KERNELS, KERNELS  # noqa: F401 (declared with the options)

PROBE_MAX_BATCH = 8   # batch sizes probed: 1..8 (micro-batches on CPUs are 1-4 tokens; 8 shows the tiled kernel)
TILED_PROBE_SIZES = (2, 3, 4, 5, 8, 16, 32)  # --kernels tiled: users' rows up to 32 (64+ rows tile the attention)
TILED_FORCE_ENV = "GGML_CPU_TILED_MM_FORCE"   # ggml-cpu/tiled/tiled.cpp, read once per process at the first multiply
PROBE_FORMAT = 5      # bump when the probe or the numerics change: invalidates cached limits (5: bf16 values on any threads)


# Extra buffer types of ggml's CPU backend that pipeinfer never loads weights into. "AMX": a build of llama.cpp
# for a CPU with AMX (llama-cpp-python builds with -march=native) puts every 2-D matrix of a type its kernels know
# in the AMX buffer, ahead of the repacked one, and its matrix multiply crashed (SIGSEGV, llama-cpp-python 0.3.36)
# on the tests' q8_0 models; it is also not the repacked gemm that `--kernels repack` names.
UNUSED_EXTRA_BUFFERS = ("AMX",)


def model_params(kernels: str):
    """llama.cpp model params for a kernel setting (the weight layout is chosen at load)."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r} (choose {', '.join(KERNELS)})")
    import llama_cpp
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = kernels not in ("no-repack", "tiled")  # the "extra buffer" holds the repacked weights
    if kernels == "tiled":
        os.environ[TILED_FORCE_ENV] = "1"
    if params.use_extra_bufts:
        drop_extra_buffer_types(UNUSED_EXTRA_BUFFERS)
    return params


def draft_kernels(kernels: str) -> str:
    """The draft's setting in a process whose target stages run `kernels`: repacked weights under `tiled` (the
    draft's numerics do not touch the output's exactness, and its one-row decodes would cost 6.5x on the tiled
    kernel; a repacked weight never reaches it). The process's tiled switch is set here too: the draft may multiply
    before the target's stage loads, and ggml reads the switch once."""
    if kernels == "tiled":
        os.environ[TILED_FORCE_ENV] = "1"
        return "repack"
    return kernels


@lru_cache(maxsize=None)
def drop_extra_buffer_types(names: tuple[str, ...]) -> None:
    """Take the extra buffer types named `names` out of the list llama.cpp's loader reads (the CPU device's
    `ggml_backend_dev_get_extra_bufts`: a null-terminated array ggml keeps for the life of the process), so no
    model loaded after this puts a weight in them. Once per process."""
    bufts, name = _extra_bufts()
    if bufts is None:
        return
    listed = []
    while bufts[len(listed)]:
        listed.append(bufts[len(listed)])
    kept = [b for b in listed if name(b) not in names]
    for i in range(len(listed)):
        bufts[i] = kept[i] if i < len(kept) else None


def extra_buffer_types() -> list[str]:
    """The names of the extra buffer types llama.cpp's loader may put weights in now, in its order of preference."""
    bufts, name = _extra_bufts()
    out: list[str] = []
    while bufts is not None and bufts[len(out)]:
        out.append(name(bufts[len(out)]))
    return out


def _extra_bufts():
    """(the CPU device's null-terminated array of extra buffer types, name of one) through ggml's C API, or
    (None, None) where the CPU backend offers none."""
    import ctypes

    import llama_cpp
    ggml = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml.so"))
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_buft_name.restype = ctypes.c_char_p
    ggml.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    cpu = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    fn = cpu and ggml.ggml_backend_reg_get_proc_address(ggml.ggml_backend_dev_backend_reg(cpu),
                                                        b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return None, None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(cpu)
    return bufts, lambda b: ggml.ggml_backend_buft_name(b).decode()


def flash_attn_type(kernels: str) -> int:
    """Flash attention is batch-invariant on the CPU; `fast` keeps llama.cpp's default (non-flash) kernels."""
    import llama_cpp
    return (llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED if kernels == "fast"
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED)


def kv_cache_types(kernels: str, one_type: bool = False) -> tuple[int, int]:
    """(K, V) cache types (ggml_type): f16 keys and bf16 values in every exact setting, on any thread count;
    llama.cpp's f16 and f16 under `fast`, and where the model needs one type (`one_type`: multi-head latent
    attention keeps V inside K's cells).

    ggml's CPU flash attention splits one query row over 512+ cells across the threads when K and V are both f16,
    and merges the parts: on 2+ threads a row decoded alone then differs from the same row in a batch (0.33 in a
    logit, Qwen2.5-Coder-1.5B, 2 threads, 300 cells), so a verified draft or a batched user would not get the bits
    the target gives one token at a time. K and V of different types keep every row on the one-row kernel, whose
    bits do not depend on the thread count either (each thread takes whole rows and heads): so one value type on
    1 thread as on many gives the same greedy answer on any number of threads, ranks and hosts (an f16 cache on
    1 thread parted from the bf16 one on 2 at the 41st token of the held-out printing-press prompt). llama.cpp
    casts an f32 cache to f16; q8_0 would need head sizes that are multiples of 32; bf16 fits any, in f16's bytes,
    and costs about 8% per token at 1000 cells. A model of one cache type keeps f16: with bf16 keys too, DeepSeek
    3.2's synthetic model parted from its own iterative answer on 3 ranks (its indexer), so on 2+ threads past 512
    cells its rows may split (docs/design.md, Exactness)."""
    f16, bf16 = 1, 30
    if kernels == "fast":
        return f16, f16
    return (f16, f16) if one_type else (f16, bf16)


@lru_cache(maxsize=1)
def numerics_id() -> str:
    """What the kernels' numerics depend on besides the model: llama.cpp build, its CPU features, the CPU."""
    import llama_cpp
    system = llama_cpp.llama_print_system_info().decode(errors="replace")
    flags = cpu_flags_line()
    return f"llama-cpp-python {llama_cpp.__version__} | {system} | {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def cpu_flags_line() -> str:
    """This CPU's feature line from /proc/cpuinfo (x86 `flags`, Arm `Features`), or '' where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def probe_exact_batch(engine, max_batch: int = PROBE_MAX_BATCH, kernels: str = DEFAULT_KERNELS) -> int:
    """Largest b such that a decode of any 1..b rows gives every row the bits it gets alone (1 when even 2 rows
    differ): b consecutive tokens of one sequence (probe_chain), and the next tokens of b sequences
    (probe_rows_across_sequences, as many as the engine holds). `tiled` tries TILED_PROBE_SIZES of both (a decode of
    one row costs what 16 do there: every size to 32 would take minutes) and takes the last exact size."""
    if kernels == "tiled":
        chain = probe_chain(engine, max(TILED_PROBE_SIZES), TILED_PROBE_SIZES)
        if chain < 2:
            return 1
        across = probe_rows_across_sequences(engine, [b for b in TILED_PROBE_SIZES if b <= chain])
        limit = 1
        for b in TILED_PROBE_SIZES:
            if b > chain or not across.get(b, True):
                break
            limit = b
        return limit
    limit = probe_chain(engine, max_batch)
    sizes = list(range(2, limit + 1))
    across = probe_rows_across_sequences(engine, sizes) if sizes else {}
    return next((b - 1 for b in sizes if not across.get(b, True)), limit)


def probe_chain(engine, max_batch: int = PROBE_MAX_BATCH, sizes: tuple[int, ...] | None = None) -> int:
    """Largest b such that decoding a probe in batches of every size 1..b (or of every size in `sizes` up to b)
    gives outputs identical to decoding it one row at a time (1 when even 2 rows differ).

    The probe is `max_batch` rows (fixed pseudo-random tokens or hidden states) in sequence 0 from position
    0; each batch size decodes them in consecutive chunks, so later chunks also attend to K/V cells that
    earlier batches wrote. The engine's cache is cleared before and after.
    """
    from ..core.protocol import Batch
    n = min(max_batch, engine.n_batch, engine.n_ctx)
    rng = np.random.default_rng(1234)
    if engine.embd_input:
        inputs = rng.standard_normal((n, engine.n_embd), dtype=np.float32)
        tokens = np.zeros(n, dtype=np.int32)
    else:
        inputs = None
        tokens = rng.integers(0, engine.n_vocab, n, dtype=np.int32)

    def decode_in_chunks(b: int) -> np.ndarray:
        engine.clear_kv()
        out = []
        for start in range(0, n, b):
            end = min(n, start + b)
            out.append(engine.decode(Batch.chain(tokens[start:end], start), None if inputs is None else inputs[start:end]))
        return np.concatenate(out)

    try:
        single = decode_in_chunks(1)
        limit = 1
        for b in (range(2, n + 1) if sizes is None else [b for b in sizes if b <= n]):
            if not np.array_equal(decode_in_chunks(b), single):
                break
            limit = b
        return limit
    finally:
        engine.clear_kv()


def probe_rows_across_sequences(engine, sizes: list[int], n_prefix: int = 8) -> dict[int, bool]:
    """Whether a decode of B rows, each the next token of its own sequence (serving many users in one batch),
    gives every row bit for bit what that row gives decoded alone: {B: exact} for each B in `sizes`.

    max(sizes) sequences each first get a distinct prefix of n_prefix rows (fixed pseudo-random tokens or hidden
    states, decoded sequence by sequence, the same cells in both conditions); then each sequence's next row is
    decoded alone, and the first B sequences' next rows together. The engine's cache is cleared before and after.
    """
    from ..core.protocol import Batch, kv_ops, rm
    n_seqs = min(max(sizes), engine.n_seq_max, engine.n_batch)
    sizes = [b for b in sizes if b <= n_seqs]
    rng = np.random.default_rng(4321)
    shape = (n_seqs, n_prefix + 1)
    if engine.embd_input:
        inputs = rng.standard_normal((*shape, engine.n_embd), dtype=np.float32)
        tokens = np.zeros(shape, dtype=np.int32)
    else:
        inputs = None
        tokens = rng.integers(0, engine.n_vocab, shape, dtype=np.int32)

    def rows(seqs: list[int], at: int, n: int = 1) -> tuple[Batch, np.ndarray | None]:
        toks = np.concatenate([tokens[s, at:at + n] for s in seqs])
        pos = np.concatenate([np.arange(at, at + n, dtype=np.int32) for _ in seqs])
        b = Batch(toks, pos, [[s] for s in seqs for _ in range(n)], np.ones(len(toks), dtype=np.int32), kv_ops())
        return b, None if inputs is None else np.concatenate([inputs[s, at:at + n] for s in seqs])

    def prefixes() -> None:
        engine.clear_kv()
        for s in range(n_seqs):
            engine.decode(*rows([s], 0, n_prefix))

    def next_rows(seqs: list[int]) -> np.ndarray:
        out = engine.decode(*rows(seqs, n_prefix))
        if getattr(engine, "recurrent", False):  # a recurrent state cannot drop its last token: decode the prefixes
            prefixes()                             # again (core/recurrent.py)
        else:
            engine.apply_kv_ops(kv_ops(*[rm(s, n_prefix, -1) for s in seqs]))
        return out

    try:
        prefixes()
        alone = np.concatenate([next_rows([s]) for s in range(n_seqs)])
        return {b: bool(np.array_equal(next_rows(list(range(b))), alone[:b])) for b in sizes}
    finally:
        engine.clear_kv()


def exact_batch_limit(engine, path: str | os.PathLike, kernels: str, n_threads: int, n_threads_batch: int,
                      known: dict[str, int] | None = None) -> int:
    """The engine's exact batch limit: cached beside the stage files per (file, kernels, threads, build, CPU); else
    the limit of a stage with the same kernel key (kernel_key: measured on this host, or in `known`, what rank 0's
    host has seen its jobs' ranks measure); else probed. Every limit goes into this host's table of kernel keys."""
    from ..core.files import derived_path, write_atomically
    settings = _probe_settings(kernels, n_threads, n_threads_batch, engine.embd_input, engine.capture_hidden)
    cache = derived_path(path, "exact", "json", *settings)
    try:
        return int(json.loads(cache.read_text())["exact_batch"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    key = kernel_key(path, kernels, n_threads, n_threads_batch, engine.embd_input, engine.capture_hidden)
    limit = exact_table().get(key, (known or {}).get(key)) if key else None
    how = "probed" if limit is None else "taken from a stage with the same kernel key"
    if limit is None:
        limit = probe_exact_batch(engine, kernels=kernels)
    most = max(TILED_PROBE_SIZES) if kernels == "tiled" else PROBE_MAX_BATCH
    record = {"exact_batch": limit, "probed_up_to": min(most, engine.n_batch, engine.n_ctx),
              "kernels": kernels, "threads": [n_threads, n_threads_batch], "build": numerics_id(), "how": how,
              "kernel_key": key}
    write_atomically(cache, lambda tmp: tmp.write_text(json.dumps(record) + "\n"))
    if key:
        record_exact({key: limit})
    return limit


def kernel_key(path: str | os.PathLike, kernels: str, n_threads: int, n_threads_batch: int, embd_input: bool,
               capture_hidden: bool) -> str | None:
    """What a stage's exact batch limit depends on: the settings (kernels, threads, its input and output), the build
    and CPU (numerics_id), each tensor's role (its name less the layer's number), type and shape, and the
    architecture's hyperparameters (its keys less block_count). The limit is where a batch's kernels first differ
    from one row's in some matrix multiply or attention, so stages alike in these have one limit: often another layer
    range of the same model (a re-formed pipeline's, or another host's). None for a stage with experts: which kernel
    multiplies an expert depends on how many of a batch's rows the router sends it, so each such stage is probed."""
    import re

    from .ggufheader import read_header
    header = read_header(path)
    if any("_exps" in n for n in header.tensors):
        return None
    arch = header.fields.get("general.architecture", "")
    arrays = tuple(k for k, (vtype, _, _) in header.spans.items() if vtype == 9 and k.startswith(f"{arch}."))
    fields = read_header(path, keep_arrays=arrays).fields if arrays else header.fields  # per-layer values in full
    hyper = sorted((k, repr(v)) for k, v in fields.items() if k.startswith(f"{arch}.") and k != f"{arch}.block_count")
    kinds = sorted({(re.sub(r"^blk\.\d+\.", "", n), t.ggml_type, t.shape) for n, t in header.tensors.items()})
    settings = _probe_settings(kernels, n_threads, n_threads_batch, embd_input, capture_hidden)
    text = repr((arch, hyper, kinds, settings))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _probe_settings(kernels: str, n_threads: int, n_threads_batch: int, embd_input: bool, capture_hidden: bool):
    """What a limit depends on besides the stage's weights: the settings, the build and CPU, the probe's format."""
    return kernels, n_threads, n_threads_batch, embd_input, capture_hidden, numerics_id(), PROBE_FORMAT


EXACT_TABLE = "exact-limits.json"  # in the stage cache: kernel key -> exact batch limit
EXACT_TABLE_MAX = 4096


def exact_table() -> dict[str, int]:
    """This host's kernel keys and their limits (empty when there is no table or it cannot be read)."""
    from ..core.files import stage_cache_dir
    try:
        table = json.loads((stage_cache_dir() / EXACT_TABLE).read_text())
        return {str(k): int(v) for k, v in table.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def record_exact(entries: dict[str, int]) -> None:
    """Add kernel keys' limits to this host's table (ranks of one host racing may lose an entry: it is measured
    again), keeping the last EXACT_TABLE_MAX."""
    from ..core.files import stage_cache_dir, write_atomically
    table = exact_table()
    if all(table.get(k) == v for k, v in entries.items()):
        return
    table.update(entries)
    table = dict(list(table.items())[-EXACT_TABLE_MAX:])
    write_atomically(stage_cache_dir() / EXACT_TABLE, lambda tmp: tmp.write_text(json.dumps(table, indent=0)))


def largest_draft(limit: int, lead: bool) -> int:
    """Most draft tokens a verification run may carry within an exact batch limit: a PipeInfer micro-batch
    is its draft tokens; a synchronous speculative tree also carries the last accepted (lead) token."""
    return limit - (1 if lead else 0)


def resolve_draft_max(requested: int | None, limit: int, lead: bool, default: int = DEFAULT_DRAFT_MAX) -> int:
    """--draft-max for a run: `requested`, or (None) the largest exact value up to `default`.

    Raises ValueError (a user error) when the request, or any speculation at all, exceeds the limit."""
    most = largest_draft(limit, lead)
    if most < 1:
        raise ValueError(f"the exact batch limit is {limit}: no draft token fits a verification batch beside the "
                         f"lead token, so speculation cannot be exact; use --mode pipeinfer (micro-batches without a lead "
                         f"token), --mode iterative, --kernels no-repack (exact to larger batches on quantized weights) "
                         f"or --kernels fast (not exact)")
    if requested is None:
        return min(default, most)
    if requested > most:
        raise ValueError(f"--draft-max {requested} makes verification batches of {requested + lead} tokens, more than "
                         f"the exact batch limit of {limit} measured for these kernels: at most {most} keeps the output "
                         f"exact (--kernels no-repack allows more, --kernels fast has no limit but is not exact)")
    return requested


def time_decodes(engine, sizes: list[int], n_fill: int = 128, n_repeat: int = 3) -> list[float]:
    """Median ms of an engine's decode of n tokens (or hidden-state rows) for each n in sizes, on top of n_fill
    positions already in its KV cache (a short prompt's worth); one untimed warm-up. The cache is cleared
    before and after."""
    import statistics
    import time

    from ..core.protocol import Batch, cp, kv_ops, rm
    from ..core.recurrent import chain_seq_ids
    rng = np.random.default_rng(0)
    n_fill = max(0, min(n_fill, engine.n_batch, engine.n_ctx - max(sizes) - 1))

    # a recurrent stage's micro-batch: nested sequences (core/recurrent.py), as many as the engine holds
    recurrent = getattr(engine, "recurrent", False)
    nested = recurrent and n_fill > 0 and engine.n_seq_max > max(sizes)

    def decode(pos0: int, n: int) -> float:
        toks = rng.integers(0, engine.n_vocab, n).astype(np.int32)  # any valid id (small test vocabularies too)
        b = Batch.chain(toks, pos0)
        if nested and pos0:  # as a speculative run decodes it: token d in sequences d+1..n, after the fill's copies
            engine.apply_kv_ops(kv_ops(*[cp(0, s) for s in range(1, n + 1)]))
            b = Batch(toks, b.pos, chain_seq_ids(list(range(1, n + 1)), n), b.output, b.prefix_ops)
        emb = rng.standard_normal((n, engine.n_embd), dtype=np.float32) * 0.1 if engine.embd_input else None
        t0 = time.perf_counter()
        engine.decode(b, emb)
        return (time.perf_counter() - t0) * 1e3

    def undo(n: int) -> None:
        if nested:
            engine.apply_kv_ops(kv_ops(*[rm(s) for s in range(1, n + 1)]))
        elif recurrent:  # a recurrent state cannot drop tokens: fill again
            engine.apply_kv_ops(kv_ops(rm(-1)))
            if n_fill:
                decode(0, n_fill)
        else:
            engine.apply_kv_ops(kv_ops(rm(0, n_fill, -1)))

    engine.apply_kv_ops(kv_ops(rm(-1)))
    if n_fill:
        decode(0, n_fill)
    out = []
    for n in sizes:
        times = []
        for k in range(n_repeat + (n == sizes[0])):
            t = decode(n_fill, n)
            undo(n)
            if k or n != sizes[0]:
                times.append(t)
        out.append(statistics.median(times))
    engine.apply_kv_ops(kv_ops(rm(-1)))
    return out
