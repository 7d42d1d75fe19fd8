"""Models with recurrent layers (hybrids: lfm2, granitehybrid, ...): how speculation keeps their state exact.

The problem. An attention layer keeps one KV cell per position, so a speculative run that is only partly accepted is
rolled back by dropping the cells after the accepted prefix (kvplan.py: commit copies [n_kv0, end) of the run's
branch into the canonical sequence). A recurrent layer (Mamba2's SSM, LFM2's short convolution, a gated delta net)
keeps one state per *sequence*: the state after the sequence's last token, with no way back. llama.cpp's recurrent
memory (src/llama-memory-recurrent.cpp, 0.3.36) refuses `seq_rm(s, p, -1)` for 0 < p <= the state's position
(returns false; llama_memory_hybrid::seq_rm then leaves the attention cells alone too), and `seq_cp(src, dst)`
ignores positions: dst shares src's state cell, whatever range was asked. So committing "tokens n_kv0..end-1" of a
run that decoded further would give the canonical sequence the state after the *last* drafted token.

What pipeinfer does: per-token states in the run's partition (nested sequences). A speculative chain of k drafted
tokens takes k sequence ids s_0..s_{k-1} of its partition, and token d carries s_d..s_{k-1} (`chain_seq_ids`;
the synchronous mode's lead token carries the canonical sequence too). Sequence s_d then holds tokens 0..d of the
chain, and llama.cpp gives it the state after token d:
  * llama_batch_allocr allows nested sequence sets (each sequence's sets intersect) and split_equal never puts two
    overlapping sets in one ubatch, so the decode runs as k one-token ubatches in batch order (the captured hidden
    rows stay in batch order), under llama.cpp's unified hybrid memory (kv_unified: the non-sequential split);
  * before each ubatch llama_memory_recurrent::find_slot gives a sequence whose state cell is shared a cell of its
    own, copied from the shared one (copy on write): after token d, s_d keeps its state while s_{d+1}.. go on.
Accepting up to token d is then the same commit as for attention, from the right sequence: seq_cp(s_d -> canonical,
n_kv0, end) copies token 0..d's attention cells and shares s_d's state cell (`state_seq`: the lowest id a node
carries is the one that ends at it). Rejected and cancelled runs are retired as before (kvplan.commit_ops: their
cells to the garbage sequence, the partition's tags removed: a state cell nobody holds is free). A run that builds
on a speculative parent copies the parent's last sequence (`main_seq`), which holds the parent's whole chain and
the state after its last token.

Why exact. Every generated token is decoded in a ubatch of its own, exactly as iterative decoding (and the
single-process reference) decodes it: the rows are bit for bit the same whatever the batch kernels do with several
rows (kernels.py's exact batch limit does not bound a hybrid's micro-batch), and so is every recurrent state,
including layers whose kernel takes another path for several tokens (qwen3next's chunked delta net). The prompt is
decoded in the same chunks as alone, as for every model.

What it costs (launch/bench/bench_recurrent.py, results/bench_recurrent.txt): a k-token micro-batch costs k one-token graph
evaluations instead of one k-row batch (3 tokens: 3.0x one token, 1.6-1.8x three rows in one decode, on the
synthetic hybrids of 75-80 MB); with --micro-batch auto, which sizes micro-batches by those measured costs,
PipeInfer's speedup over iterative on 2 ranks was 0.81-1.04 of an attention model's of the same size at the same
draft accuracy. And partitions hold draft_max sequence ids instead of max_branches, so llama.cpp's recurrent memory,
one state cell per sequence id (n_seq_max cells, each a state per recurrent layer), holds 2 + partitions x draft_max
(+ generation slots) states. Not supported for such models: token trees (--max-branches
above 1: a sibling would need a sequence of its own beside the nested ones), the prompt cache (an entry's state
exists only at its end, not at every prefix a later prompt shares), a draft *model* with recurrent layers (the
drafter rolls its own sequence back), and speculation on purely recurrent models (mamba, rwkv: llama.cpp's
sequential split refuses tokens of several sequences).

Splitting. llama.cpp's hybrid graph input sets the attention cache's and the recurrent state's inputs on every decode
(llama-graph.cpp:1095, llm_graph_input_mem_hybrid::set_input: llama_kv_cache::set_input_k_idxs asserts a host
buffer that a graph without an attention layer never allocates, and :1111 rs_s_copy's without a recurrent layer), so a
stage must hold at least one layer of each kind: `check_stage` is the architecture's range rule (stagefile.SplitRule
metadata), so the balanced split keeps to such ranges and a split or stage file without is refused in one line.
"""
from __future__ import annotations

from .errors import UserError

# llama-arch.cpp (0.3.36): llm_arch_is_recurrent and llm_arch_is_hybrid
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID_ARCHS = frozenset({"jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
                          "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
                          "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01"})

ATTN, RECR, OTHER = "attention", "recurrent", "other"


class RecurrentError(UserError):
    """A setting a model with recurrent layers cannot run with (one line for the user)."""


def has_recurrent_state(arch: str) -> bool:
    """Whether llama.cpp keeps a recurrent state (one cell per sequence) for this architecture."""
    return arch in RECURRENT_ARCHS or arch in HYBRID_ARCHS


def check_recurrent_config(arch: str, mode: str, max_branches: int, draft_arch: str | None = None) -> None:
    """RecurrentError for what speculation on a model with recurrent layers, or with such a draft model, cannot do
    (module docstring)."""
    if mode == "iterative":
        return
    if draft_arch is not None and has_recurrent_state(draft_arch):
        raise RecurrentError(f"the draft model ({draft_arch}) has recurrent layers: a draft model rolls its own "
                             f"sequence back after a rejected token, which a recurrent state cannot do; use a draft "
                             f"with attention layers only, or --drafter ngram")
    if not has_recurrent_state(arch):
        return
    if arch in RECURRENT_ARCHS:
        raise RecurrentError(f"{arch} has only recurrent layers: llama.cpp's sequential split for such models refuses "
                             f"a token of several sequences, which --mode {mode} needs (per-token states); use "
                             f"--mode iterative")
    if max_branches > 1:
        raise RecurrentError(f"--max-branches {max_branches}: {arch} has recurrent layers, whose speculative runs are "
                             f"chains (each drafted token keeps its state in a sequence of its own); use "
                             f"--max-branches 1")


def seqs_per_run(state_per_token: bool, max_branches: int, draft_max: int) -> int:
    """Sequence ids a speculative run's partition holds: one per drafted token (nested) for a model with recurrent
    layers, else one per tree branch."""
    return draft_max if state_per_token else max_branches


def chain_seq_ids(seqs: list[int], n: int) -> list[list[int]]:
    """The sequence ids of each of a chain's n drafted tokens, nested: token d carries seqs[d:n], so seqs[d] ends at
    token d (and holds the recurrent state after it)."""
    if n > len(seqs):
        raise ValueError(f"a chain of {n} tokens needs {n} sequences, the partition has {len(seqs)}")
    return [list(seqs[d:n]) for d in range(n)]


def state_seq(node_seq_ids: list[int], canon: int) -> int:
    """The sequence whose cells end at a node: nested, the lowest id it carries; in a tree, any branch through it (its
    cells up to the node are every such branch's), so the lowest too."""
    return min(s for s in node_seq_ids if s != canon)


def main_seq(seqs: list[int], n_nodes: int, nested: bool) -> int:
    """The sequence that holds a run's whole main chain, which a later run builds on: the last of a nested chain,
    branch 0 of a tree."""
    return seqs[n_nodes - 1] if nested else seqs[0]


# ---------------------------------------------------------------- layers of each kind, for splitting
def _kv_heads(fields: dict, arch: str, n_layer: int) -> list[int]:
    value = fields.get(f"{arch}.attention.head_count_kv", fields.get(f"{arch}.attention.head_count", 0))
    return [int(x) for x in value[:n_layer]] if isinstance(value, (list, tuple)) else [int(value)] * n_layer


def _by_kv_heads(fields: dict, arch: str, n_layer: int) -> list[str]:
    """lfm2, granitehybrid (models/lfm2.cpp, granite-hybrid.cpp: load_arch_hparams): a layer is recurrent iff its
    head_count_kv is 0."""
    return [RECR if h == 0 else ATTN for h in _kv_heads(fields, arch, n_layer)]


def _by_recurrent_layers(fields: dict, arch: str, n_layer: int) -> list[str]:
    """qwen3next (models/qwen3next.cpp: load_arch_hparams, as qwen35.cpp and qwen35moe.cpp): the per-layer
    `attention.recurrent_layers` if the file has it (llama.cpp reads it first), else a gated delta net unless
    (il + 1) % full_attention_interval == 0 (4 without the key); the prediction blocks after the trunk attend."""
    value = fields.get(f"{arch}.attention.recurrent_layers")
    if isinstance(value, (list, tuple)):
        return [RECR if x else ATTN for x in value[:n_layer]]
    interval = int(fields.get(f"{arch}.full_attention_interval", 4))
    n_trunk = int(fields.get(f"{arch}.block_count", n_layer)) - int(fields.get(f"{arch}.nextn_predict_layers", 0))
    return [RECR if il < n_trunk and (il + 1) % interval else ATTN for il in range(n_layer)]


# the architectures whose layer kinds are read here, as llama.cpp derives them (the ones stagefile.SPLIT_RULES admits)
LAYER_KINDS = {"lfm2": _by_kv_heads, "granitehybrid": _by_kv_heads, "qwen3next": _by_recurrent_layers,
               "qwen35": _by_recurrent_layers, "qwen35moe": _by_recurrent_layers}


def layer_kinds(arch: str, fields: dict, n_layer: int) -> list[str] | None:
    """Each layer's kind (ATTN, RECR, OTHER) from a GGUF's key-values ({arch}.* with per-layer arrays); None for an
    architecture without recurrent layers or whose kinds are not known here."""
    fn = LAYER_KINDS.get(arch)
    return fn(fields, arch, n_layer) if fn is not None else None


def stage_ok(kinds: list[str], start: int, end: int) -> bool:
    """Whether llama.cpp can decode layers [start, end) as a stage: at least one attention and one recurrent layer."""
    part = kinds[start:end]
    return ATTN in part and RECR in part


def check_stage(arch: str, fields: dict, start: int, end: int) -> str | None:
    """Why a stage file of layers [start, end) would abort llama.cpp's decode, or None (a hybrid's stage needs a
    layer of each kind: the module docstring)."""
    n_layer = int(fields.get(f"{arch}.block_count", end))
    kinds = layer_kinds(arch, fields, n_layer)
    if kinds is None or stage_ok(kinds, start, end) or (start, end) == (0, n_layer):
        return None
    missing = "attention" if ATTN not in kinds[start:end] else "recurrent"
    return (f"{arch}: layers [{start}, {end}) hold no {missing} layer, and llama.cpp aborts decoding a hybrid file "
            f"without one of each (llm_graph_input_mem_hybrid::set_input, llama-graph.cpp:1095 and :1111, asserts "
            f"buffers only such layers allocate); choose a split whose every stage holds both")
