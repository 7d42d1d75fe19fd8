"""Machines you describe, and a target you may not have: what `pipeinfer plan --machines` prices.

A described host is a hostfile line whose `# pipeinfer:` comment gives its physical `cores`, RAM (`mem`, GiB),
memory bandwidth (`mem_bw`, GB/s), free `disk` (GiB), `link` (Mbit/s) and optionally `speed` (a core's decode speed
relative to a core of the profiled host). The target is a GGUF read from its header (`target_from_gguf`) or a size
named in NAMED_TARGETS.

The host model is a roofline calibrated on the profiled host (`Calibration.of`): a one-token decode of a stage
streams its active weight bytes S once, so it takes
    max(S / (eta x mem_bw),  S / compute_rate(threads) x batch_ratio(rows)) + fixed
where compute_rate is the profiled host's bytes per ms per core at one row (its measured layer cost and the
profiled model's layer bytes), times `speed`, times the threads' Amdahl speed-up (its serial share measured by
`profile` at 1..cores threads, else SERIAL_SHARE); batch_ratio(rows) is the profiled cost of `rows` rows over one
row (a compute-bound host pays for rows, a memory-bound one streams the weights once for all of them); eta is the
share of peak bandwidth a decode reaches (BW_EFFICIENCY; llama.cpp's token generation reaches 60-80% of a
STREAM-measured bandwidth on servers). A prompt-sized batch is compute-bound: the profiled prompt cost per row over
the one-row cost. From those, `described_profile` writes the profile `pipeinfer profile` would measure on the
described hosts, so the twin (sim.py) and plan's search run on it unchanged.

What fits (`fit`): a host's RAM holds its stage's weights (all experts), its KV cache for n_ctx positions, and
RUNTIME_GIB for llama.cpp's buffers and Python; its disk holds its stage file, and the first host the whole GGUF as
well. The first start sends every other stage file from the first host, one host at a time over the slower of the
two links (ranks/weights.py).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from ..core.topology import layer_ranges

BW_EFFICIENCY = 0.7    # share of a host's peak memory bandwidth a one-token decode streams weights at
SERIAL_SHARE = 0.05    # the share of a decode that does not speed up with threads, where profile did not measure it
RUNTIME_GIB = 1.0      # RAM per rank beside weights and KV cache: compute buffers, the runtime, Python
N_CTX = 4096           # KV positions a plan sizes for (serve's default context)
LAN_LATENCY_US = 100.0 # one-way latency of a switched Gigabit LAN with kernel TCP
SAME_HOST = (5e-6, 5e9)
PROFILED_DRAFT_BYTES = 253e6  # gemma-3-270m Q4_K_M, the draft of a profile that did not record its size
Q6_K_BITS = 6.5625     # bits per weight of Q6_K, a Q4_K_M file's output projection  # ranks of one host talk through shared memory: latency s, bytes/s


@dataclass(frozen=True)
class Machine:
    """One described host (a hostfile line with describing keys)."""
    name: str
    slots: int = 1
    cores: int = 1
    mem_gib: float | None = None
    mem_bw_gbps: float | None = None
    disk_gib: float | None = None
    link_mbit: float = 1000.0
    speed: float = 1.0
    threads: int | None = None
    weight: float | None = None
    role: str = "stage"

    @property
    def rank_threads(self) -> int:
        """Threads of the host's first rank: the hostfile's threads=, else its share of the cores (thread_of)."""
        return self.thread_of(0)

    def thread_of(self, index: int) -> int:
        """Threads of the host's rank `index` (0..slots-1) when -t does not say: the hostfile's threads=, else the
        described cores dealt among its ranks as a rank takes them by default (core/cpus.share)."""
        from ..core.cpus import share
        return self.threads or share(self.cores, self.slots, index)


def machines_from_hosts(hosts) -> list[Machine]:
    """wire.launcher.Host lines -> Machines; `cores` is required (the host model needs it)."""
    missing = [h.name for h in hosts if h.cores is None]
    if missing:
        raise ValueError(f"plan --machines: give each host its physical cores ('# pipeinfer: cores=N ...'); "
                         f"missing on {', '.join(missing)}")
    return [Machine(h.name, h.slots, h.cores, h.mem, h.mem_bw, h.disk, h.link or 1000.0, h.speed or 1.0,
                    h.threads, h.weight, h.role) for h in hosts]


# ==================================================================== the target
@dataclass(frozen=True)
class Target:
    """What a plan needs of a model: per-layer bytes (all of them, and what one token reads), the first stage's
    token embeddings, the last stage's output projection, the KV cache's bytes per position and layer."""
    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    layer_bytes: float           # mean bytes per layer, every expert
    active_layer_bytes: float    # mean bytes one token reads per layer
    embd_bytes: float            # token_embd.weight (rank 0 embeds)
    out_bytes: float             # output.weight, or token_embd again where tied, and the final norm
    kv_bytes_per_pos_layer: float
    file_bytes: float
    draft_bytes: float = 0.0     # its usual draft's file (engine/drafts.py pairs them); 0: unknown
    pre: str = ""                # its tokenizer's tokenizer.ggml.pre (engine/drafts.py pairs by it); "": unknown
    # mean bytes per layer of one sequence's recurrent state (hybrids: recurrent_state_bytes over the recurrent
    # layers, spread over all), which llama.cpp allocates for every sequence id of the context (n_seq_max)
    state_bytes_per_seq_layer: float = 0.0
    n_expert: int = 0                # routed experts per layer (0: dense)
    n_expert_used: int = 0           # experts one token reads per layer
    expert_layer_bytes: float = 0.0  # mean bytes per layer of the routed experts, all of them

    def cache_bytes_per_layer(self, n_ctx: int, n_seq: int) -> float:
        """What one (mean) layer's context holds beside its weights: its KV cache for n_ctx positions, its recurrent
        states for n_seq sequence ids."""
        return self.kv_bytes_per_pos_layer * n_ctx + self.state_bytes_per_seq_layer * n_seq

    def stage_bytes(self, n_layers: int, first: bool, last: bool) -> float:
        return n_layers * self.layer_bytes + (self.embd_bytes if first else 0.0) + (self.out_bytes if last else 0.0)

    def active_stage_bytes(self, n_layers: int, last: bool) -> float:
        """Bytes a one-token decode of the stage streams (the embedding is a row lookup, not a read)."""
        return n_layers * self.active_layer_bytes + (self.out_bytes if last else 0.0)

    def experts_read(self, rows: int) -> float:
        """Distinct experts a decode of `rows` rows reads in a layer, each row routed to n_expert_used of n_expert
        independently and alike: E x (1 - (1 - k/E)^rows); k for one row, all E for many (0 for a dense model)."""
        if not self.n_expert:
            return 0.0
        return self.n_expert * (1.0 - (1.0 - self.n_expert_used / self.n_expert) ** max(1, rows))

    def read_layer_bytes(self, rows: int) -> float:
        """Mean bytes per layer a decode of `rows` rows reads: what one row reads, and for a mixture of experts the
        bytes of the other experts the further rows are routed to (a dense layer reads the same for any rows)."""
        if not self.n_expert:
            return self.active_layer_bytes
        per_expert = self.expert_layer_bytes / self.n_expert
        return self.active_layer_bytes + per_expert * (self.experts_read(rows) - self.n_expert_used)

    def read_stage_bytes(self, n_layers: int, last: bool, rows: int) -> float:
        """Bytes a decode of `rows` rows of the stage reads (rows = 1: active_stage_bytes)."""
        return n_layers * self.read_layer_bytes(rows) + (self.out_bytes if last else 0.0)

    def rank_ram_bytes(self, n_layers: int, first: bool, last: bool, n_ctx: int, n_seq: int = 1) -> float:
        """RAM one stage rank holds: its weights (every expert), its context (KV cache for n_ctx cells, a hybrid's
        states for n_seq sequence ids) and RUNTIME_GIB (what `plan` prices and `launch --dry-run` checks)."""
        return (self.stage_bytes(n_layers, first, last) + n_layers * self.cache_bytes_per_layer(n_ctx, n_seq)
                + RUNTIME_GIB * GIB)


def _named(name, arch, pre, n_layer, n_embd, n_vocab, n_head_kv, head_dim, file_gb, draft_gb, embd_bits=4.5,
           out_bits=Q6_K_BITS, moe: "Moe | None" = None, kv_bytes: float | None = None) -> Target:
    """A target from its published shape and file size: the layers hold the file less the token embeddings and the
    output projection (Q4_K_M quantizes those Q4_K and Q6_K); a mixture of experts' routed share of a layer's bytes
    is its share of the layer's parameters (Moe.routed_share)."""
    embd = n_vocab * n_embd * embd_bits / 8
    out = n_vocab * n_embd * out_bits / 8
    layer = (file_gb * 1e9 - embd - out) / n_layer
    kv = kv_bytes if kv_bytes is not None else 2 * n_head_kv * head_dim * 2
    if moe is None:
        return Target(name, arch, n_layer, n_embd, n_vocab, layer, layer, embd, out, kv, file_gb * 1e9,
                      draft_gb * 1e9, pre)
    experts = layer * moe.routed_share(n_embd, n_layer)
    active = layer - experts + experts * moe.n_used / moe.n_expert
    return Target(name, arch, n_layer, n_embd, n_vocab, layer, active, embd, out, kv, file_gb * 1e9, draft_gb * 1e9,
                  pre, n_expert=moe.n_expert, n_expert_used=moe.n_used, expert_layer_bytes=experts)


@dataclass(frozen=True)
class Moe:
    """A mixture of experts' shape, from its config.json: routed experts (n_expert of n_ff each, n_used per token),
    shared experts' and dense layers' FFN widths, attention (query heads x head_dim; kv_dim: the K and V
    projections' output), the first n_dense layers dense."""
    n_expert: int
    n_used: int
    n_ff: int
    attn: int             # parameters of a layer's attention projections
    n_ff_shared: int = 0
    n_dense: int = 0
    n_ff_dense: int = 0

    def routed_share(self, n_embd: int, n_layer: int) -> float:
        """The routed experts' share of the layers' parameters (the router and norms neglected)."""
        routed = (n_layer - self.n_dense) * self.n_expert * 3 * n_embd * self.n_ff
        rest = (n_layer * self.attn + (n_layer - self.n_dense) * 3 * n_embd * self.n_ff_shared
                + self.n_dense * 3 * n_embd * self.n_ff_dense)
        return routed / (routed + rest)


def _attn(n_embd: int, n_head: int, n_head_kv: int, head_dim: int) -> int:
    """q, k, v and o projections' parameters."""
    return n_embd * head_dim * (2 * n_head + 2 * n_head_kv)


def _llama70(name: str) -> Target:
    return _named(name, "llama", "llama-bpe", 80, 8192, 128256, 8, 128, 42.52, 0.81)


def _qwen235() -> Target:
    return _named("Qwen3-235B-A22B Q4_K_M", "qwen3moe", "qwen2", 94, 4096, 151936, 4, 128, 142.6, 0.48,
                  moe=Moe(128, 8, 1536, _attn(4096, 64, 4, 128)))


#: Targets named by size, for a plan before any download: their published shapes (config.json: layers, width,
#: vocabulary, KV heads x head_dim, experts) and the sizes of their usual GGUF files (Q4_K_M; gpt-oss ships MXFP4).
#: The draft is the pairing's (engine/drafts.py, by the tokenizer): Llama-3.2-1B Q4_K_M 0.81 GB, Qwen2.5-Coder-0.5B
#: Q4_K_M 0.49 GB (the registry's), Qwen3-0.6B 0.48 GB; a family without a small sibling of its tokenizer (Llama 2,
#: GLM, gpt-oss, DeepSeek) drafts with Gemma 3 270M translated through text, 0.25 GB. gpt-oss's sliding-window layers keep 128 cells and
#: DeepSeek's MLA cache is (512 + 64) + 512 f16 per cell and layer; the first is priced as a full cache (an upper
#: bound), the second as llama.cpp keeps it.
NAMED_TARGETS = {
    "8b-q4_k_m": _named("Llama-3.1-8B Q4_K_M", "llama", "llama-bpe", 32, 4096, 128256, 8, 128, 4.92, 0.81),
    "32b-q4_k_m": _named("Qwen2.5-32B Q4_K_M", "qwen2", "qwen2", 64, 5120, 152064, 8, 128, 19.85, 0.49),
    "70b-q4_k_m": _llama70("Llama-3-70B Q4_K_M"),
    "llama-3.3-70b-q4_k_m": _llama70("Llama-3.3-70B Q4_K_M"),
    "70b-q4_0": _named("Llama-2-70B Q4_0", "llama", "default", 80, 8192, 32000, 8, 128, 38.87, 0.25, out_bits=4.5),
    "235b-a22b-q4_k_m": _qwen235(),
    "qwen3-235b-a22b-q4_k_m": _qwen235(),
    "qwen3-30b-a3b-q4_k_m": _named("Qwen3-30B-A3B Q4_K_M", "qwen3moe", "qwen2", 48, 2048, 151936, 4, 128, 18.56, 0.48,
                                   moe=Moe(128, 8, 768, _attn(2048, 32, 4, 128))),
    "glm-4.5-air-q4_k_m": _named("GLM-4.5-Air Q4_K_M", "glm4moe", "glm4", 46, 4096, 151552, 8, 128, 72.9, 0.25,
                                 moe=Moe(128, 8, 1408, _attn(4096, 96, 8, 128), n_ff_shared=1408, n_dense=1,
                                         n_ff_dense=10944)),
    "gpt-oss-120b-mxfp4": _named("gpt-oss-120b MXFP4", "gpt-oss", "gpt-4o", 36, 2880, 201088, 8, 64, 63.4, 0.25,
                                 embd_bits=8.5, out_bits=8.5, moe=Moe(128, 4, 2880, _attn(2880, 64, 8, 64))),
    "gpt-oss-20b-mxfp4": _named("gpt-oss-20b MXFP4", "gpt-oss", "gpt-4o", 24, 2880, 201088, 8, 64, 12.1, 0.25,
                                embd_bits=8.5, out_bits=8.5, moe=Moe(32, 4, 2880, _attn(2880, 64, 8, 64))),
    "deepseek-v3-q4_k_m": _named("DeepSeek-V3 Q4_K_M", "deepseek2", "deepseek-v3", 61, 7168, 129280, 1, 0, 404.4,
                                 0.25, moe=Moe(256, 8, 2048, 187_105_280, n_ff_shared=2048, n_dense=3,
                                               n_ff_dense=18432), kv_bytes=(576 + 512) * 2),
    "405b-q4_k_m": _named("Llama-3.1-405B Q4_K_M", "llama", "llama-bpe", 126, 16384, 128256, 8, 128, 243.0, 0.81),
}


def named_target(name: str) -> Target | None:
    """The target a size name names (NAMED_TARGETS; any case, `.gguf` allowed), or None: `plan --model-size` and
    `models drafts SIZE` share it."""
    key = name.strip().lower().removesuffix(".gguf")
    return NAMED_TARGETS.get(key)


def named_draft_hint(name: str) -> str | None:
    """What to pass as --draft for a target named by size (engine/drafts.py's pairing by its tokenizer), or None
    when the name is not a size."""
    t = named_target(name)
    if t is None:
        return None
    from ..engine.drafts import TRANSLATED, Tokenizer, pairing_for
    p = pairing_for(Tokenizer(t.arch, t.pre, t.n_vocab))
    if p is TRANSLATED:
        return f"--draft gemma3-270m ({t.name}: no small model shares its tokenizer, one drafts through text)"
    return f"--draft {p.file} ({p.family}: {p.draft}, the same tokenizer; from {p.source})"


def recurrent_state_bytes(arch: str, f: dict) -> float:
    """Bytes of one sequence's state in one recurrent layer, as llama.cpp 0.3.36 allocates it (f32 rows of
    llama_hparams::n_embd_r, the convolution's, and n_embd_s, the scan's, in llama-memory-recurrent.cpp): LFM2's
    short convolution holds n_embd x (l_cache - 1); a Mamba-2 or gated delta net layer (granitehybrid,
    qwen3next, qwen35) (d_conv - 1) x (d_inner + 2 x groups x d_state) and d_state x d_inner."""
    def key(name: str) -> int:
        return int(f.get(f"{arch}.{name}", 0) or 0)
    if key("shortconv.l_cache"):
        return 4.0 * key("embedding_length") * (key("shortconv.l_cache") - 1)
    d_conv, d_inner, d_state = key("ssm.conv_kernel"), key("ssm.inner_size"), key("ssm.state_size")
    conv = max(0, d_conv - 1) * (d_inner + 2 * key("ssm.group_count") * d_state)
    return 4.0 * (conv + d_state * d_inner)


def target_from_gguf(path) -> Target:
    """A GGUF's sizes from its header alone (ggufheader.py: no tensor data is read); a hybrid's KV cache for its
    attention layers only, and its recurrent states (recurrent_state_bytes)."""
    import os

    from ..core.recurrent import ATTN, RECR, layer_kinds
    from ..engine.ggufheader import model_size, read_header
    arch = read_header(path).fields["general.architecture"]
    per_layer = (f"{arch}.attention.head_count_kv", f"{arch}.attention.recurrent_layers")
    header = read_header(path, keep_arrays=per_layer)
    f, tensors = header.fields, header.tensors
    n_layer = int(f[f"{arch}.block_count"]) - int(f.get(f"{arch}.nextn_predict_layers", 0))
    n_embd = int(f[f"{arch}.embedding_length"])
    n_head = int(f.get(f"{arch}.attention.head_count", 1) or 1)
    kv = f.get(f"{arch}.attention.head_count_kv", n_head)
    kv_heads = [int(x) for x in kv[:n_layer]] if isinstance(kv, (list, tuple)) else [int(kv or n_head)] * n_layer
    kinds = layer_kinds(arch, f, n_layer) or [ATTN] * n_layer
    n_head_kv = sum(h for h, k in zip(kv_heads, kinds) if k == ATTN) / n_layer   # mean over layers: KV in attention
    state = recurrent_state_bytes(arch, f) * kinds.count(RECR) / n_layer if RECR in kinds else 0.0
    head_dim = int(f.get(f"{arch}.attention.key_length", n_embd // max(1, n_head)))
    used, experts = f.get(f"{arch}.expert_used_count"), f.get(f"{arch}.expert_count")
    share = int(used) / int(experts) if used and experts else 1.0
    every = active = experts_bytes = 0.0
    for name, t in tensors.items():
        if name.startswith("blk.") and int(name.split(".")[1]) < n_layer:
            every += t.nbytes
            active += t.nbytes * (share if "_exps" in name else 1.0)
            experts_bytes += t.nbytes if "_exps" in name else 0.0
    embd = tensors["token_embd.weight"].nbytes if "token_embd.weight" in tensors else 0.0
    out_t = tensors.get("output.weight") or tensors.get("token_embd.weight")
    norm = tensors.get("output_norm.weight")
    out = sum(t.nbytes for t in (out_t, norm) if t is not None)
    return Target(os.path.basename(os.fspath(path)), arch, n_layer, n_embd, int(f.get("tokenizer.ggml.tokens", 0)),
                  every / n_layer, active / n_layer, float(embd), float(out), 2.0 * n_head_kv * head_dim * 2,
                  float(model_size(path)), pre=str(f.get("tokenizer.ggml.pre", "")), state_bytes_per_seq_layer=state,
                  n_expert=int(experts or 0) if used else 0, n_expert_used=int(used or 0) if experts else 0,
                  expert_layer_bytes=experts_bytes / n_layer if used and experts else 0.0)


# ==================================================================== the host model
@dataclass(frozen=True)
class Calibration:
    """The profiled host, as rates a described host scales (see the module's docstring)."""
    bytes_per_ms_per_core: float   # one-row decode, compute-bound, per thread
    batch_ratio: list[float]       # cost of b rows over one row, b = 1..len
    prompt_ratio: float            # a prompt row's cost over a one-row decode's, per byte
    fixed_ms: float                # a stage's cost beside its layers, one row
    serial_share: float = SERIAL_SHARE
    bw_efficiency: float = BW_EFFICIENCY
    draft_ms_per_token: float = 0.0
    draft_prefill_ms_per_token: float = 0.0
    draft_threads: int = 1
    draft_bytes: float = 0.0       # the profiled draft's file
    head_overhead_ms: float = 0.3
    exact_batch: int = 3
    shared_slowdown: float = 1.0

    @classmethod
    def of(cls, prof: dict) -> "Calibration":
        """From a profile (profile.py): its ranks' one-row decodes as it calibrated them inside the pipeline,
        against the bytes their stages stream (model.active_layer_bytes and out_bytes; a profile that predates
        them: the file's bytes less a tied Q6_K vocabulary, over the layers), per thread; its ranks' costs by rows
        and per prompt row over one row."""
        lm, model, ranks = prof["layer_model"], prof["model"], prof["ranks"]
        layer_b = model.get("active_layer_bytes") or _layer_bytes_estimate(model)
        out_b = model.get("out_bytes") or model["n_vocab"] * model["n_embd"] * Q6_K_BITS / 8
        fixed = lm["fixed_ms"][0]
        streamed = sum((r["layers"][1] - r["layers"][0]) * layer_b + (out_b if r["last"] else 0.0) for r in ranks)
        spent = sum(r["ms_by_batch"][0] - fixed for r in ranks)
        serial = prof.get("serial_share", SERIAL_SHARE)
        threads = statistics.median(int(r.get("threads", 1)) for r in ranks)
        b = min(len(r["ms_by_batch"]) for r in ranks)
        draft = prof.get("draft") or {}
        from .cluster import draft_ms_per_proposal
        return cls(bytes_per_ms_per_core=streamed / spent / _amdahl(threads, serial),
                   batch_ratio=[statistics.mean(r["ms_by_batch"][i] / r["ms_by_batch"][0] for r in ranks)
                                for i in range(b)],
                   prompt_ratio=statistics.mean(r["prompt_ms_per_token"] / r["ms_by_batch"][0] for r in ranks),
                   fixed_ms=fixed, serial_share=serial,
                   draft_ms_per_token=draft_ms_per_proposal(prof),
                   draft_prefill_ms_per_token=draft.get("prefill_ms_per_token", 0.0),
                   draft_threads=int(ranks[0].get("threads", 1)),
                   draft_bytes=float(draft.get("file_bytes", PROFILED_DRAFT_BYTES)),
                   head_overhead_ms=prof.get("head_overhead_ms", 0.3),
                   exact_batch=int(prof.get("exact_batch", 3)),
                   shared_slowdown=prof.get("shared_slowdown", 1.0))

    def compute_rate(self, m: Machine, threads: int) -> float:
        """Bytes per ms a rank of `threads` threads on m decodes one row at, compute-bound."""
        return self.bytes_per_ms_per_core * m.speed * _amdahl(threads, self.serial_share)

    def memory_rate(self, m: Machine) -> float:
        """Bytes per ms m streams weights at (inf where its bandwidth is not described)."""
        return math.inf if not m.mem_bw_gbps else m.mem_bw_gbps * 1e6 * self.bw_efficiency

    def stage_ms(self, m: Machine, threads: int, active_bytes: float, rows: int,
                 read_bytes: float | None = None) -> float:
        """One decode of `rows` rows of a stage whose one row reads active_bytes on m, the rows together
        `read_bytes` (None: active_bytes; a mixture of experts' further rows read other experts:
        Target.read_stage_bytes). Compute: active_bytes at one row times the profiled cost of `rows` rows over one
        (rows past the profiled table: the table's last ratio grown linearly to the prompt rate at 64 rows, as
        cluster.StageCost does); memory: the bytes read, streamed once for all rows."""
        compute = active_bytes / self.compute_rate(m, threads)
        b = len(self.batch_ratio)
        if rows <= b:
            ratio = self.batch_ratio[rows - 1]
        else:
            ratio = max(self.batch_ratio[-1], rows * self.prompt_ratio)
        streamed = active_bytes if read_bytes is None else read_bytes
        return max(streamed / self.memory_rate(m), compute * ratio) + self.fixed_ms

    def draft_ms(self, m: Machine, threads: int, draft_bytes: float) -> float:
        """A draft of draft_bytes per token on m: the profiled draft's cost scaled by bytes and compute rate,
        or streaming its weights, whichever is slower."""
        here = self.bytes_per_ms_per_core * _amdahl(self.draft_threads, self.serial_share)
        by_bytes = draft_bytes / self.draft_bytes if self.draft_bytes and draft_bytes else 1.0
        compute = self.draft_ms_per_token * by_bytes * here / self.compute_rate(m, threads)
        return max(compute, draft_bytes / self.memory_rate(m))


def _amdahl(threads: int, serial: float) -> float:
    return 1.0 / (serial + (1.0 - serial) / max(1, threads))


def _layer_bytes_estimate(model: dict) -> float:
    vocab_bytes = model["n_vocab"] * model["n_embd"] * Q6_K_BITS / 8  # embeddings tied with the output
    return (model["file_bytes"] - vocab_bytes) / model["n_layer"]


def serial_share_from(ms_by_threads: list[float]) -> float:
    """Amdahl's serial share from one-row decode times at 1..n threads (least squares on
    ms(t) / ms(1) = s + (1 - s) / t); 0..1."""
    if len(ms_by_threads) < 2:
        return SERIAL_SHARE
    xs = [1.0 - 1.0 / t for t in range(1, len(ms_by_threads) + 1)]       # (ms(1) - ms(t)) / ms(1) = (1 - s) x
    ys = [1.0 - ms / ms_by_threads[0] for ms in ms_by_threads]
    den = sum(x * x for x in xs)
    return min(1.0, max(0.0, 1.0 - sum(x * y for x, y in zip(xs, ys)) / den)) if den else SERIAL_SHARE


# ==================================================================== the split, the fit, the profile
@dataclass
class RankPlan:
    """One rank of the described cluster."""
    rank: int
    machine: Machine
    threads: int
    layers: tuple[int, int] = (0, 0)
    first: bool = False
    last: bool = False
    draft: bool = False


@dataclass
class HostFit:
    """What one host must hold, against what it has."""
    machine: Machine
    ram_gib: float
    disk_gib: float
    problems: list[str] = field(default_factory=list)


GIB = float(1 << 30)


def ranks_of(machines: list[Machine]) -> list[RankPlan]:
    """Ranks as `pipeinfer launch` places them: host by host, a role=draft host last."""
    stage_hosts = [m for m in machines if m.role != "draft"]
    out = [RankPlan(0, m, m.thread_of(i)) for m in stage_hosts for i in range(m.slots)]
    out += [RankPlan(0, m, m.rank_threads, draft=True) for m in machines if m.role == "draft"]
    for i, r in enumerate(out):
        r.rank = i
    return out


def context_seqs(target: Target, n_stages: int) -> int:
    """Sequence ids each stage's context holds (n_seq_max), where they cost memory: a hybrid's (its recurrent states)
    in PipeInfer as start-up plans one stream, each drafted token's state in a sequence of its own
    (core/recurrent.py: 2 + partitions x draft_max); 1 for a model without recurrent layers (its KV cache is
    sized by positions, whatever the sequences)."""
    if not target.state_bytes_per_seq_layer:
        return 1
    from ..core.config import DEFAULT_DRAFT_MAX
    from ..core.kvplan import in_flight_limit, plan_partitions
    return plan_partitions(DEFAULT_DRAFT_MAX, in_flight_limit(None, n_stages))[1]


def capacity_layers(r: RankPlan, target: Target, n_ctx: int, sharing: int, n_seq: int = 1) -> int:
    """Layers rank r can hold in its share of its host's RAM (no limit where RAM is not described)."""
    if r.machine.mem_gib is None:
        return target.n_layer
    room = r.machine.mem_gib * GIB / sharing - RUNTIME_GIB * GIB - target.out_bytes - target.embd_bytes
    return max(0, int(room // (target.layer_bytes + target.cache_bytes_per_layer(n_ctx, n_seq))))


def split_layers(stages: list[RankPlan], target: Target, cal: Calibration, n_ctx: int) -> list[int]:
    """Layers per stage rank: the least time per token (the slowest stage's one-row decode), each rank within its
    RAM; weights from the hostfile (`weight=`) win where every stage host gives one. Binary search on that time."""
    if all(r.machine.weight is not None for r in stages):
        ws = [r.machine.weight for r in stages]
        return [rr.n_layers for rr in layer_ranges(target.n_layer, [w / sum(ws) for w in ws])]
    sharing = {r.machine.name: sum(1 for s in stages if s.machine.name == r.machine.name) for r in stages}
    n_seq = context_seqs(target, len(stages))
    caps = [capacity_layers(r, target, n_ctx, sharing[r.machine.name], n_seq) for r in stages]
    if sum(caps) < target.n_layer:
        return caps  # does not fit: fit() says where

    def per_layer_ms(r: RankPlan) -> float:
        return cal.stage_ms(r.machine, r.threads, target.active_layer_bytes, 1) - cal.fixed_ms

    def layers_within(t_ms: float) -> list[int]:
        out = []
        for i, r in enumerate(stages):
            last = i == len(stages) - 1
            extra = (cal.stage_ms(r.machine, r.threads, target.out_bytes, 1) if last else 0.0) + cal.fixed_ms
            out.append(min(caps[i], max(0, int((t_ms - extra) // per_layer_ms(r)))))
        return out

    lo, hi = 0.0, sum(cal.stage_ms(r.machine, r.threads, target.active_stage_bytes(target.n_layer, True), 1)
                      for r in stages)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(layers_within(mid)) < target.n_layer else (lo, mid)
    counts = layers_within(hi)
    extra = sum(counts) - target.n_layer
    for i in sorted(range(len(counts)), key=lambda i: -counts[i]):  # hand back what overshoots, from the largest
        take = min(extra, counts[i] - 1)
        counts[i] -= take
        extra -= take
    return counts


def place(machines: list[Machine], target: Target, cal: Calibration, n_ctx: int = N_CTX) -> list[RankPlan]:
    ranks = ranks_of(machines)
    stages = [r for r in ranks if not r.draft]
    if not stages:
        raise ValueError("plan --machines: every host has role=draft; the target's stages need one")
    if len(stages) > target.n_layer:
        raise ValueError(f"plan --machines: {len(stages)} stage ranks for {target.n_layer} layers")
    start = 0
    for r, n in zip(stages, split_layers(stages, target, cal, n_ctx)):
        r.layers = (start, start + n)
        start += n
    stages[0].first, stages[-1].last = True, True
    return ranks


def with_counts(ranks: list[RankPlan], counts: list[int]) -> list[RankPlan]:
    """The ranks with the stage ranks holding `counts` layers each, in order (another split of the same hosts)."""
    out, start, stages = [], 0, iter(counts)
    for r in ranks:
        n = 0 if r.draft else next(stages)
        out.append(replace(r, layers=(start, start + n) if not r.draft else (0, 0)))
        start += n
    return out


def fit(ranks: list[RankPlan], target: Target, n_ctx: int = N_CTX, draft_bytes: float = 0.0,
        draft_beside_head: bool = False) -> list[HostFit]:
    """RAM and disk each host needs (its ranks together: Target.rank_ram_bytes, a hybrid's recurrent states for
    every sequence id, context_seqs; the draft on the role=draft host, or with `draft_beside_head` beside rank 0)
    against what it has; a line per shortfall."""
    fits: dict[str, HostFit] = {}
    n_seq = context_seqs(target, sum(1 for r in ranks if not r.draft))
    for r in ranks:
        m = r.machine
        hf = fits.setdefault(m.name, HostFit(m, 0.0, 0.0))
        if r.draft:
            hf.ram_gib += (draft_bytes + RUNTIME_GIB * GIB) / GIB
            continue
        n = r.layers[1] - r.layers[0]
        weights = target.stage_bytes(n, r.first, r.last)
        hf.ram_gib += (target.rank_ram_bytes(n, r.first, r.last, n_ctx, n_seq)
                       + (draft_bytes if draft_beside_head and r.rank == 0 else 0.0)) / GIB
        hf.disk_gib += (weights + (target.file_bytes if r.first else 0.0)) / GIB
    for hf in fits.values():
        m = hf.machine
        if sum(r.layers[1] - r.layers[0] for r in ranks if r.machine is m and not r.draft) == 0 and m.role != "draft":
            hf.problems.append(f"{m.name}: no layers fit in its {m.mem_gib:g} GiB of RAM")
        if m.mem_gib is not None and hf.ram_gib > m.mem_gib:
            hf.problems.append(f"{m.name}: needs {hf.ram_gib:.1f} GiB of RAM, has {m.mem_gib:g}")
        if m.disk_gib is not None and hf.disk_gib > m.disk_gib:
            hf.problems.append(f"{m.name}: needs {hf.disk_gib:.1f} GiB of disk, has {m.disk_gib:g}")
    placed = sum(r.layers[1] - r.layers[0] for r in ranks)
    if placed < target.n_layer:
        first = next(iter(fits.values()))
        first.problems.append(f"the hosts' RAM holds {placed} of the {target.n_layer} layers of {target.name}")
    return list(fits.values())


def first_start_s(ranks: list[RankPlan], target: Target, draft_bytes: float = 0.0) -> float:
    """Seconds the first start moves weights: every other host's stage file (and the draft) from the first host,
    one host at a time, each over the slower of the two links."""
    head = ranks[0].machine
    total = 0.0
    for r in ranks:
        if r.machine.name == head.name:
            continue
        n = r.layers[1] - r.layers[0]
        nbytes = draft_bytes if r.draft else target.stage_bytes(n, r.first, r.last)
        total += nbytes / (min(head.link_mbit, r.machine.link_mbit) * 1e6 / 8)
    return total


def link_between(a: Machine, b: Machine, latency_us: float) -> dict:
    """The link between two described hosts, as a profile records it: one-way latency (s) and bits/s (the slower
    host's link=; ranks of one host talk through shared memory, SAME_HOST)."""
    if a.name == b.name:
        return {"latency_s": SAME_HOST[0], "bandwidth_bps": SAME_HOST[1] * 8}
    return {"latency_s": latency_us * 1e-6, "bandwidth_bps": min(a.link_mbit, b.link_mbit) * 1e6}


def described_profile(machines: list[Machine], target: Target, cal: Calibration, prof: dict,
                      n_ctx: int = N_CTX, latency_us: float = LAN_LATENCY_US,
                      draft_bytes: float = 0.0) -> tuple[dict, list[RankPlan]]:
    """The profile `pipeinfer profile` would measure on the described hosts with the target (profile.py's
    format; the draft's measured confidence is the profiled pair's), and the ranks it places."""
    ranks = place(machines, target, cal, n_ctx)
    stages = [r for r in ranks if not r.draft]
    b = len(cal.batch_ratio)
    records = []
    for r in stages:
        n = r.layers[1] - r.layers[0]
        active = target.active_stage_bytes(n, r.last)
        ms = [cal.stage_ms(r.machine, r.threads, active, rows, target.read_stage_bytes(n, r.last, rows))
              for rows in range(1, b + 1)]
        prompt = cal.stage_ms(r.machine, r.threads, active, 64, target.read_stage_bytes(n, r.last, 64)) / 64
        records.append({"rank": r.rank, "host": r.machine.name, "machine": r.machine.name, "cores": r.machine.cores,
                        "threads": r.threads, "layers": list(r.layers), "last": r.last,
                        "ms_by_batch": ms, "prompt_ms_per_token": prompt})
    # the layer model of the target on a host like the first stage's (the search prices other splits with it,
    # each rank by its speed relative to this model)
    r0 = stages[0]
    one_layer = [cal.stage_ms(r0.machine, r0.threads, target.active_layer_bytes, rows,
                              target.read_layer_bytes(rows)) - cal.fixed_ms for rows in range(1, b + 1)]
    out = [cal.stage_ms(r0.machine, r0.threads, target.out_bytes, rows) - cal.fixed_ms for rows in range(1, b + 1)]
    lm = {"probe_layers": 1, "fixed_ms": [cal.fixed_ms] * b, "layer_ms": one_layer, "out_ms": out,
          "prompt_fixed_ms_per_token": cal.fixed_ms / 64,
          "prompt_layer_ms_per_token": (cal.stage_ms(r0.machine, r0.threads, target.active_layer_bytes, 64,
                                                     target.read_layer_bytes(64)) - cal.fixed_ms) / 64,
          "prompt_out_ms_per_token": (cal.stage_ms(r0.machine, r0.threads, target.out_bytes, 64) - cal.fixed_ms) / 64}
    links = []
    for i, r in enumerate(stages):
        nxt = stages[(i + 1) % len(stages)]
        links.append({"from": r.rank, "to": nxt.rank, **link_between(r.machine, nxt.machine, latency_us)})
    drafter = next((r for r in ranks if r.draft), r0)
    draft = dict(prof.get("draft") or {})
    draft.pop("translating", None)
    draft["ms_per_token"] = cal.draft_ms(drafter.machine, drafter.threads, draft_bytes)
    draft["prefill_ms_per_token"] = cal.draft_prefill_ms_per_token * draft["ms_per_token"] / max(
        cal.draft_ms_per_token, 1e-9)
    out_prof = {"format": prof.get("format", 1), "described": True, "kernels": prof.get("kernels"),
                "exact_batch": cal.exact_batch, "shared_slowdown": cal.shared_slowdown,
                "model": {"path": target.name, "n_layer": target.n_layer, "n_embd": target.n_embd,
                          "n_vocab": target.n_vocab, "file_bytes": target.file_bytes},
                "ranks": records, "links": links, "layer_model": lm, "draft": draft,
                "head_overhead_ms": cal.head_overhead_ms}
    return out_prof, ranks
