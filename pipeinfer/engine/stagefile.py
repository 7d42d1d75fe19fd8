"""Stage files: a GGUF holding only a range of another GGUF's layers.

llama.cpp refuses a file whose tensor count disagrees with `{arch}.block_count`, so each stage is a file
of its own: tensors blk.{a}..blk.{b-1} renamed blk.0.., raw (quantized) data copied as is, per-layer
metadata arrays sliced to the range, and every rule llama.cpp derives from the layer index written out
(SPLIT_RULES: one verified architecture each; others are refused). A stage that does not produce logits gets a 4-token dummy
vocabulary and [4, n_embd] embedding/output tensors, so marking all its rows as outputs (needed to
capture hidden states) costs no vocabulary-sized projection. Files are cached, keyed by the source's
identity (path, size, mtime) and the range. A split GGUF (gguf_parts.py) is a source like another, named by its
first part: its stage files take tensors from every part, drop the split keys and are named after the set.
"""
from __future__ import annotations

import functools
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..core.files import derived_path, write_atomically

STAGE_FORMAT = 3  # bump when the stage file layout changes: invalidates the cache


class StageFileError(ValueError):
    """A model that cannot be split as asked (one-line message for the user)."""


@dataclass(frozen=True)
class SplitRule:
    """What a stage file carries so that an architecture's renumbered layers compute what they did in place.

    llama.cpp (src/models/<arch>.cpp, 0.3.36) derives some per-layer behaviour from the layer index il of the
    file it loads; a stage renumbers layers from 0, so each such rule is written out explicitly here."""
    care: str                      # the rule that needed care (docs/architectures.md)
    swa_period: int = 0            # windowed layers: il % period < period - 1, unless the file has the per-layer
    #                                `attention.sliding_window_pattern` (llama.cpp reads it first): always written
    dense_lead: bool = False       # `leading_dense_block_count` dense FFN layers, then experts: counted from
    #                                the stage's first layer
    first_stage_keys: tuple[str, ...] = ()  # scalings the graph applies to its input, hidden states included:
    #                                only the first stage keeps them
    metadata: Callable | None = None  # (fields, start, end, with_vocab) -> {key: (value, type)} to write, or
    #                                StageFileError for a range llama.cpp would misread
    per_layer_keys: tuple[str, ...] = ()  # per-layer arrays outside the `{arch}.` keys (apertus's `xielu.*`):
    #                                sliced to the stage's range like the architecture's own


def _deepseek2_metadata(fields: dict, start: int, end: int, with_vocab: bool, arch: str = "deepseek2") -> dict:
    """DeepSeek-V2/V3 derive two things from the file's layer count and vocabulary (models/deepseek2.cpp): a
    26/27-layer file is "lite" (no q_lora_rank, q projected directly) and a GLM-4.7-Lite-sized one gates experts
    with a sigmoid. Write both as the whole model has them, and refuse a range llama.cpp would misread. (mistral4
    loads through the same code, under its own keys: `arch`.)"""
    import gguf
    u32 = gguf.GGUFValueType.UINT32
    n_layer = int(fields[f"{arch}.block_count"]) - int(fields.get(f"{arch}.nextn_predict_layers", 0))
    n_vocab = int(fields.get(f"{arch}.vocab_size", 0))  # _stage_metadata adds it from token_embd if absent

    def lite(n, v):
        return n in (26, 27) or (n == 48 and v == 128256)
    out = {}
    q_lora = int(fields.get(f"{arch}.attention.q_lora_rank", 0))  # absent in a lite model: 0, q projected directly
    if lite(end - start, n_vocab if with_vocab else 4):
        if q_lora > 0:
            raise StageFileError(f"{arch}: llama.cpp reads a {end - start}-layer file as DeepSeek-V2-Lite (no "
                                 f"q_lora_rank), which this model is not; choose a split without a stage of that size")
    else:
        out[f"{arch}.attention.q_lora_rank"] = (q_lora, u32)  # read (and required) only outside the lite sizes
    if int(fields.get(f"{arch}.expert_gating_func", 0)) == 0:  # 0: unset, llama.cpp guesses from the sizes
        sigmoid = n_layer in (47, 48) and n_vocab == 154880
        out[f"{arch}.expert_gating_func"] = (2 if sigmoid else 1, u32)
    return out


def _granite_metadata(fields: dict, start: int, end: int, with_vocab: bool) -> dict:
    """Granite Vision's deepstack (models/granite.cpp) adds the input embeddings to chosen layers' inputs and then
    leaves embedding input unscaled: neither survives a split into stages."""
    if "granite.deepstack_mapping" in fields:
        raise StageFileError("granite: deepstack layers (Granite Vision) read the model's input embeddings at "
                             "later layers, which a later stage does not have; run it on 1 rank")
    return {}


# ---- dense and MoE families (issue 55)
def _command_r_metadata(fields: dict, start: int, end: int, with_vocab: bool) -> dict:
    """Command R+ normalizes q and k, and llama.cpp creates those norms only for a file of 64 layers or more
    (models/command-r.cpp:28, `if (n_layer >= 64)`): a smaller stage of such a model leaves them unread and does
    not load."""
    if int(fields["command-r.block_count"]) >= 64 and end - start < 64:
        raise StageFileError("command-r: llama.cpp reads the q/k norms of a 64-layer model (Command R+) only from a "
                             "file of 64 layers or more (models/command-r.cpp:28), which a stage is not; run it on "
                             "1 rank")
    return {}


def _exaone4_metadata(fields: dict, start: int, end: int, with_vocab: bool) -> dict:
    """EXAONE 4.0 has windowed attention (3 of every 4 layers, RoPE only there) only where the file has exactly 64
    layers (models/exaone4.cpp:4, `if (hparams.n_layer() == 64)`, the 32B); any other file runs full attention with
    RoPE everywhere. No key turns it on or off: a stage must keep the whole model's choice."""
    n_layer = int(fields["exaone4.block_count"]) - int(fields.get("exaone4.nextn_predict_layers", 0))
    if (n_layer == 64) != (end - start == 64):
        raise StageFileError(f"exaone4: llama.cpp turns windowed attention on only for a file of exactly 64 layers "
                             f"(models/exaone4.cpp:4), so a {end - start}-layer stage of this {n_layer}-layer model "
                             f"would compute another model; run it on 1 rank")
    return {}


def _ernie4_5_moe_metadata(fields: dict, start: int, end: int, with_vocab: bool) -> dict:
    """ERNIE 4.5 MoE routes experts in layers il >= leading_dense_block_count with (il + 1) % step == 0
    (models/ernie4-5-moe.cpp:64); the dense lead is counted from each stage's start (dense_lead), and the step
    survives renumbering only from a multiple of it (the published models have step 1)."""
    step = int(fields.get("ernie4_5-moe.interleave_moe_layer_step", 1))
    if step > 1 and start % step:
        raise StageFileError(f"ernie4_5-moe: llama.cpp places expert layers by (il + 1) % {step} "
                             f"(models/ernie4-5-moe.cpp:64), so a stage must start at a multiple of {step}, not "
                             f"at layer {start}; choose another --layer-split")
    return {}


def _grok_metadata(fields: dict, start: int, end: int, with_vocab: bool) -> dict:
    """Grok's embedding scale multiplies hidden-state input too (llama-graph.cpp, build_inp_embd), and a file
    without the key gets 78.38 (models/grok.cpp:7): a later stage is written 0, which llama.cpp reads as no
    scaling."""
    import gguf
    return {"grok.embedding_scale": (0.0, gguf.GGUFValueType.FLOAT32)} if start > 0 else {}


def _nope_every_4th(arch: str, line: str) -> Callable:
    """SmolLM3 and AFMoE run their layers without RoPE where (il + 1) % 4 == 0, the 4 fixed in llama.cpp's source
    with no key or per-layer array to carry it: that holds in a stage that starts at a multiple of 4."""
    def metadata(fields: dict, start: int, end: int, with_vocab: bool) -> dict:
        if start % 4:
            raise StageFileError(f"{arch}: llama.cpp runs layers without RoPE where (il + 1) % 4 == 0 ({line}, the "
                                 f"4 fixed in the source with no key to carry it), so a stage must start at a "
                                 f"multiple of 4; layers {start}-{end - 1} do not (--layer-split balanced, the "
                                 f"default, keeps to that)")
        return {}
    return metadata


# ---- glm4, llama4, deepseek32, mistral4 (issue 55)
def _llama4_metadata(fields: dict, start: int, end: int, with_vocab: bool) -> dict:
    """Llama 4 derives two kinds of layer from the layer index, with no key or per-layer array to carry either
    (models/llama4.cpp): no RoPE where (il + 1) % 4 == 0 (line 143; the 4 is llama-hparams.h:258's, read from no key)
    and experts where (il + 1) % interleave_moe_layer_step == 0 (line 62). Both hold in a stage that starts at a
    multiple of 4 and of the step. And the graph feeds its attention-temperature input (line 121) only to the
    layers without RoPE: in a file that has none, llama.cpp aborts setting it (llm_graph_input_attn_temp::set_input,
    llama-graph.cpp:172, "tensor buffer not set"), so a stage holds at least one such layer (4 layers or more)."""
    n_layer, n = int(fields["llama4.block_count"]), end - start
    if (start, end) == (0, n_layer):
        return {}
    window = fields.get("llama4.attention.sliding_window")
    if window is not None and int(window) == 0:  # models/llama4.cpp:9-11: n_no_rope_layer_step = n_layer
        raise StageFileError("llama4: with attention.sliding_window 0 llama.cpp runs the last layer of each file "
                             "without RoPE (n_no_rope_layer_step = n_layer, models/llama4.cpp:11), so every stage "
                             "but the last would lose RoPE in its last layer; run it on 1 rank")
    step = int(fields["llama4.interleave_moe_layer_step"])
    if start % 4 or n < 4:
        raise StageFileError(f"llama4: llama.cpp runs layers without RoPE where (il + 1) % 4 == 0 "
                             f"(models/llama4.cpp:143, the 4 fixed in llama-hparams.h:258 with no key to carry it) "
                             f"and aborts on a file without such a layer (llama-graph.cpp:172), so a stage must start at "
                             f"a multiple of 4 and hold 4 layers or more; layers {start}-{end - 1} do not "
                             f"(--layer-split balanced, the default, keeps to that)")
    if step > 0 and start % step:
        raise StageFileError(f"llama4: llama.cpp places expert layers where (il + 1) % {step} == 0 "
                             f"(models/llama4.cpp:62, interleave_moe_layer_step), so a stage must start at a multiple "
                             f"of {step}, not at layer {start} (--layer-split balanced, the default, keeps to that)")
    return {}


_GLM_INPUT = ("the graph aborts on hidden-state input unless the file has M-RoPE sections (models/glm4.cpp:84, "
              "glm4-moe.cpp:307): a stage decodes token 0 and the engine writes its hidden states over that row "
              "(`embd`, through cb_eval: stage.TOKEN_INPUT_ONLY), so RoPE and positions stay the whole model's")


# ---- hybrid and recurrent families (issue 55)
def _hybrid_metadata(fields: dict, start: int, end: int, with_vocab: bool, arch: str = "") -> dict:
    """A hybrid's stage holds an attention layer and a recurrent layer: llama.cpp aborts decoding a hybrid file
    without one of each (core/recurrent.check_stage names the line). Which layer is which is per-layer metadata
    (head_count_kv 0: recurrent), sliced with the layers."""
    from ..core.recurrent import check_stage
    why = check_stage(arch, fields, start, end)
    if why:
        raise StageFileError(why)
    return {}


_HYBRID = ("each layer attention or {kind} by its head_count_kv (0: {kind}), a per-layer array sliced with the "
           "layers; every stage holds a layer of each kind (llama.cpp aborts on a hybrid file without); speculative "
           "runs keep each drafted token's recurrent state in a sequence of its own (core/recurrent.py)")


def _recurrent_layers_metadata(fields: dict, start: int, end: int, with_vocab: bool, arch: str = "") -> dict:
    """Qwen3-Next makes a layer a gated delta net unless (il + 1) % full_attention_interval == 0
    (models/qwen3next.cpp:17-22), from the file's own layer index, but reads the per-layer
    `attention.recurrent_layers` first (line 17, llama-model-loader.cpp get_key_or_arr): every stage gets the whole
    model's layer kinds as that array, sliced to its range, so a stage may start anywhere; and, as every hybrid, holds
    a layer of each kind (_hybrid_metadata)."""
    import gguf

    from ..core.recurrent import RECR, layer_kinds
    _hybrid_metadata(fields, start, end, with_vocab, arch)
    kinds = layer_kinds(arch, fields, end)
    return {f"{arch}.attention.recurrent_layers": ([k == RECR for k in kinds[start:end]], gguf.GGUFValueType.ARRAY)}


_QWEN35_INPUT = ("M-RoPE: hidden-state input would take 4 positions a token (llama-batch.cpp:98), so a stage decodes "
                 "token 0 and the engine writes its hidden states over that row (`embd`, through cb_eval: "
                 "stage.TOKEN_INPUT_ONLY), positions the whole model's text positions")


# Architectures verified to split exactly (tests/test_architectures.py runs each one's synthetic model whole and
# as chained stages); SPLITTABLE is this table's keys.
SPLIT_RULES: dict[str, SplitRule] = {
    "llama": SplitRule("none (Mixtral-style experts included)"),
    "qwen2": SplitRule("none"),
    "qwen3": SplitRule("none"),
    "qwen3moe": SplitRule("none: every layer routes its experts alike"),
    "gemma2": SplitRule("windowed attention on even layers (il % 2); the graph scales every input by "
                        "sqrt(n_embd), hidden states included (stage.SCALES_EVERY_INPUT)", swa_period=2),
    "gemma3": SplitRule("windowed attention except every 6th layer (il % 6), another RoPE base there",
                        swa_period=6),
    "phi3": SplitRule("none (llama.cpp runs Phi-3's window as full attention)"),
    "olmo2": SplitRule("with a sliding window: full attention every 4th layer (il % 4)", swa_period=4),
    "granite": SplitRule("embedding_scale multiplies hidden-state input too: only the first stage keeps it",
                         first_stage_keys=("embedding_scale",), metadata=_granite_metadata),
    "deepseek2": SplitRule("leading dense layers; 'lite' and expert gating guessed from the file's size; "
                           "multi-token-prediction blocks after the trunk stay out of every stage",
                           dense_lead=True, metadata=_deepseek2_metadata),
    "gpt-oss": SplitRule("windowed attention on even layers (il % 2)", swa_period=2),
    # ---- dense and MoE families (issue 55)
    "mistral3": SplitRule("none (attention temperature follows the position; experts where the file has them)"),
    "qwen2moe": SplitRule("none: every layer routes its experts alike, beside a gated shared expert"),
    "olmoe": SplitRule("none: every layer routes its experts alike"),
    "granitemoe": SplitRule("embedding_scale multiplies hidden-state input too: only the first stage keeps it",
                            first_stage_keys=("embedding_scale",)),
    "cohere2": SplitRule("windowed attention with RoPE on 3 of every 4 layers, full attention without RoPE on the "
                         "4th (il % 4)", swa_period=4),
    "command-r": SplitRule("none below 64 layers; llama.cpp reads Command R+'s q/k norms only from a file of 64 "
                           "layers or more, so its stages are refused", metadata=_command_r_metadata),
    "gemma": SplitRule("the graph scales every input by sqrt(n_embd), hidden states included "
                       "(stage.SCALES_EVERY_INPUT)"),
    "minimax-m2": SplitRule("none: every layer routes its experts alike (sigmoid gating with a bias)"),
    "ernie4_5": SplitRule("none"),
    "ernie4_5-moe": SplitRule("leading dense layers; experts where (il + 1) % step == 0, so a stage starts at a "
                              "multiple of the step (1 in the published models)", dense_lead=True,
                              metadata=_ernie4_5_moe_metadata),
    "exaone4": SplitRule("none below 64 layers; llama.cpp turns windowed attention on only for a 64-layer file "
                         "(EXAONE 4.0 32B), whose stages are refused", metadata=_exaone4_metadata),
    "seed_oss": SplitRule("none"),
    "starcoder2": SplitRule("none"),
    "hunyuan-moe": SplitRule("none: every layer routes its experts alike, beside a shared expert"),
    "dots1": SplitRule("leading dense layers, then experts", dense_lead=True),
    "bailingmoe2": SplitRule("leading dense layers, then experts; multi-token-prediction blocks after the trunk "
                             "stay out of every stage", dense_lead=True),
    "arcee": SplitRule("none"),
    "apertus": SplitRule("per-layer xIELU activation parameters under keys without the architecture's prefix "
                         "(xielu.*): sliced too", per_layer_keys=("xielu.alpha_n", "xielu.alpha_p", "xielu.beta",
                                                                  "xielu.eps")),
    "phimoe": SplitRule("none"),
    "dbrx": SplitRule("none"),
    "grok": SplitRule("the embedding scale multiplies hidden-state input too and is 78.38 where the file has no "
                      "key: later stages are written 0", metadata=_grok_metadata),
    "smollm3": SplitRule("no RoPE where (il + 1) % 4 == 0, the 4 fixed in llama.cpp: a stage starts at a multiple "
                         "of 4 (others refused, the balanced split keeps to it)",
                         metadata=_nope_every_4th("smollm3", "models/smollm3.cpp:69")),
    "afmoe": SplitRule("no RoPE where (il + 1) % 4 == 0, the 4 fixed in llama.cpp: a stage starts at a multiple "
                       "of 4 (others refused, the balanced split keeps to it); windowed attention on 3 of every 4 "
                       "layers (il % 4); leading dense layers; the graph scales every input by sqrt(n_embd), hidden "
                       "states included (stage.SCALES_EVERY_INPUT)", swa_period=4, dense_lead=True,
                       metadata=_nope_every_4th("afmoe", "models/afmoe.cpp:135")),
    # ---- glm4, llama4, deepseek32, mistral4 (issue 55)
    "glm4": SplitRule(_GLM_INPUT),
    "glm4moe": SplitRule("leading dense layers, then experts; multi-token-prediction blocks after the trunk stay out "
                         "of every stage; " + _GLM_INPUT, dense_lead=True),
    "llama4": SplitRule("no RoPE where (il + 1) % 4 == 0 and experts where (il + 1) % interleave_moe_layer_step "
                        "== 0, neither in a key, and llama.cpp aborts on a file without a RoPE-less layer: a stage "
                        "starts at a multiple of 4 and of the step and holds 4 layers or more (others refused, the "
                        "balanced split keeps to it); chunked attention except every 4th layer: the per-layer "
                        "pattern", swa_period=4, metadata=_llama4_metadata),
    "deepseek32": SplitRule("leading dense layers (the lightning indexer is per-layer tensors and keys); "
                            "multi-token-prediction blocks after the trunk stay out of every stage", dense_lead=True),
    "mistral4": SplitRule("deepseek2's loader: leading dense layers, 'lite' and expert gating guessed from the file's "
                          "size, so both are written out", dense_lead=True,
                          metadata=functools.partial(_deepseek2_metadata, arch="mistral4")),
    # ---- hybrid and recurrent families (issue 55)
    "lfm2": SplitRule(_HYBRID.format(kind="short convolution"),
                      metadata=functools.partial(_hybrid_metadata, arch="lfm2")),
    "granitehybrid": SplitRule(_HYBRID.format(kind="Mamba2") + "; embedding_scale multiplies hidden-state input "
                               "too: only the first stage keeps it", first_stage_keys=("embedding_scale",),
                               metadata=functools.partial(_hybrid_metadata, arch="granitehybrid")),
    "qwen3next": SplitRule("gated delta net layers except where (il + 1) % full_attention_interval == 0: written out "
                           "as the per-layer attention.recurrent_layers, which llama.cpp reads first; every stage "
                           "holds a layer of each kind (llama.cpp aborts on a hybrid file without); speculative runs "
                           "keep each drafted token's recurrent state in a sequence of its own (core/recurrent.py); "
                           "multi-token-prediction blocks after the trunk stay out of every stage",
                           metadata=functools.partial(_recurrent_layers_metadata, arch="qwen3next")),
    "qwen35": SplitRule("qwen3next's layer kinds, written out the same way; " + _QWEN35_INPUT,
                        metadata=functools.partial(_recurrent_layers_metadata, arch="qwen35")),
    "qwen35moe": SplitRule("qwen3next's layer kinds, written out the same way; " + _QWEN35_INPUT,
                           metadata=functools.partial(_recurrent_layers_metadata, arch="qwen35moe")),
}
SPLITTABLE = frozenset(SPLIT_RULES)

# Architectures llama.cpp cannot run split, and the rule that stops them (check_splittable names it).
NOT_SPLITTABLE = {
    # ---- dense and MoE families (issue 55)
    "gemma3n": "between layers llama.cpp's gemma3n graph carries n_altup streams of n_embd "
               "(models/gemma3n.cpp:126, [n_embd, n_tokens, n_altup]) and per-layer inputs projected from the first "
               "layer's input (line 115), while a stage passes on one [n_tokens, n_embd] hidden state",
}

# Fixed-length arrays that are not per layer, whatever a tiny model's layer count
NOT_PER_LAYER = ("rope.dimension_sections",)


@dataclass(frozen=True)
class ModelInfo:
    arch: str
    n_layer: int   # the layers a decode runs: block_count less trailing multi-token-prediction blocks
    n_embd: int
    n_vocab: int


def read_info(path: str | os.PathLike) -> ModelInfo:
    """Architecture and sizes from a GGUF header (fast: see ggufheader.py)."""
    from .gguf_parts import SplitSetError
    from .ggufheader import NotGGUF, read_header
    try:
        header = read_header(path)
        fields = header.fields
    except SplitSetError as e:
        raise StageFileError(str(e)) from None
    except (NotGGUF, OSError, UnicodeDecodeError, struct.error) as e:
        raise StageFileError(f"{path}: not a GGUF file ({e})") from None
    arch = fields.get("general.architecture")
    if arch is None:
        raise StageFileError(f"{path}: GGUF without general.architecture")
    n_layer, n_embd = fields.get(f"{arch}.block_count"), fields.get(f"{arch}.embedding_length")
    if n_layer is None or n_embd is None:
        raise StageFileError(f"{path}: GGUF lacks {arch}.block_count or {arch}.embedding_length")
    _check_tensor_data(path, header.tensors)
    n_trunk = int(n_layer) - int(fields.get(f"{arch}.nextn_predict_layers", 0))
    return ModelInfo(arch, n_trunk, int(n_embd), int(fields.get("tokenizer.ggml.tokens", 0)))


def layer_costs(path: str | os.PathLike) -> tuple[list[float], float]:
    """What a token costs each layer of the decoding trunk and the output (the final norm and the vocabulary
    projection: output.weight, or token_embd.weight where the model ties them), in MB of weights read per token
    (a one-token decode on a CPU streams its weights): for --layer-split balanced. An expert tensor counts the
    share of experts a token uses (expert_used_count of expert_count)."""
    from .ggufheader import read_header
    header = read_header(path)
    fields, tensors = header.fields, header.tensors
    arch = fields["general.architecture"]
    n_layer = int(fields[f"{arch}.block_count"]) - int(fields.get(f"{arch}.nextn_predict_layers", 0))
    used, experts = fields.get(f"{arch}.expert_used_count"), fields.get(f"{arch}.expert_count")
    expert_share = int(used) / int(experts) if used and experts else 1.0
    per_layer = [0.0] * n_layer
    for name, t in tensors.items():
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if il < n_layer:
                per_layer[il] += t.nbytes / 1e6 * (expert_share if "_exps" in name else 1.0)
    out = tensors.get("output.weight") or tensors.get("token_embd.weight")
    norm = tensors.get("output_norm.weight")
    tail = sum(t.nbytes for t in (out, norm) if t is not None) / 1e6
    return per_layer, tail


def _check_tensor_data(path, tensors) -> None:
    """Every tensor's data lies inside its file (a truncated copy, or part of a split GGUF, fails here, not inside
    llama.cpp)."""
    sizes: dict[str, int] = {}
    for t in tensors.values():
        file = t.file or os.fspath(path)
        if file not in sizes:
            sizes[file] = os.path.getsize(file)
        try:
            end = t.offset + t.nbytes
        except (ValueError, KeyError):
            raise StageFileError(f"{file}: tensor {t.name} has ggml type {t.ggml_type}, unknown to this build") from None
        if end > sizes[file]:
            raise StageFileError(f"{file}: truncated GGUF: tensor {t.name} needs bytes up to {end:,}, "
                                 f"the file has {sizes[file]:,} (an incomplete download or copy?)")


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _metadata_fields(reader, arch: str) -> dict:
    """What a SplitRule.metadata function reads: the architecture's keys, `{arch}.vocab_size` from token_embd
    where the file has no such key."""
    n_vocab = next((int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight"), 0)
    fields = {f.name: f.contents() for f in reader.fields.values() if f.name.startswith(f"{arch}.")}
    return fields | {f"{arch}.vocab_size": fields.get(f"{arch}.vocab_size", n_vocab)}


@dataclass(frozen=True)
class RangeCheck:
    """Which layer ranges of a model its SplitRule lets a stage hold, decided from the header alone (picklable: rank 0
    reads the file, every rank plans the split with it, before any stage file is written)."""
    arch: str
    n_layer: int
    fields: dict

    def refusal(self, start: int, end: int) -> str | None:
        """Why a stage of layers [start, end) would compute another model (the rule's one line), or None."""
        rule = SPLIT_RULES.get(self.arch)
        if rule is None or rule.metadata is None:
            return None
        try:
            rule.metadata(self.fields, start, end, end == self.n_layer)
        except StageFileError as e:
            return str(e)
        return None


def range_check(src: str | os.PathLike) -> RangeCheck:
    """src's RangeCheck, from its header (milliseconds: HeaderReader)."""
    reader = HeaderReader(src)
    arch = _field(reader, "general.architecture")
    n_layer = int(_field(reader, f"{arch}.block_count")) - int(_field(reader, f"{arch}.nextn_predict_layers") or 0)
    return RangeCheck(arch, n_layer, _metadata_fields(reader, arch))


def check_splittable(info: ModelInfo, n_stages: int) -> None:
    if n_stages > 1 and info.arch in NOT_SPLITTABLE:
        raise StageFileError(f"architecture '{info.arch}' cannot be split into stages: {NOT_SPLITTABLE[info.arch]}; "
                             f"run it on 1 rank instead")
    if n_stages > 1 and info.arch not in SPLITTABLE:
        raise StageFileError(
            f"architecture '{info.arch}' is not verified for layer splitting (renumbering layers may change "
            f"the model); supported: {', '.join(sorted(SPLITTABLE))}; run it on 1 rank instead")


def stage_path(src: str | os.PathLike, start: int, end: int, with_vocab: bool) -> Path:
    label = f"L{start}-{end}{'' if with_vocab else '.novocab'}"
    return _derived(src, label, "gguf", start, end, with_vocab, STAGE_FORMAT)


def _derived(src: str | os.PathLike, label: str, ext: str, *key: object) -> Path:
    """core.files.derived_path of a model: for a split GGUF keyed by every part's identity too and named after the
    set (NAME.L0-14..., not NAME-00001-of-00003.L0-14...)."""
    from .gguf_parts import set_stem
    from .ggufheader import model_files
    files = model_files(src)
    if len(files) == 1:
        return derived_path(src, label, ext, *key)
    parts = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files[1:]]
    out = derived_path(src, label, ext, *key, *parts)
    return out.with_name(set_stem(src) + out.name[len(Path(src).stem):])


def source_reader(src):
    """What _stage_writer reads src with: gguf.GGUFReader for one file, HeaderReader (every part's tensors) for a
    split GGUF."""
    import gguf

    from .ggufheader import model_files
    return HeaderReader(src) if len(model_files(src)) > 1 else gguf.GGUFReader(str(src), "r")


def ensure_stage_file(src: str | os.PathLike, start: int, end: int, with_vocab: bool) -> Path:
    """Path of the stage file for layers [start, end) of src, written on first use."""
    out = stage_path(src, start, end, with_vocab)
    if not out.exists():
        write_atomically(out, lambda tmp: write_stage_file(src, tmp, start, end, with_vocab))
    return out


def model_part_path(src: str | os.PathLike, label: str, *key: object) -> Path:
    """Where a file derived from src (beside its stage files) is kept: NAME.LABEL.HASH.gguf."""
    return _derived(src, label, "gguf", *key)


def write_model_part(src, dst, keep: Callable[[str], bool]) -> None:
    """A GGUF with every key-value of src and the tensors whose names keep() takes, as they are (the MTP part of a
    model: engine/mtp.py)."""
    reader = source_reader(src)
    _write_tensors(_copy_writer(reader, dst), [(t.name, t.data, t.tensor_type) for t in reader.tensors
                                               if keep(t.name)])


def write_stage_file(src, dst, start: int, end: int, with_vocab: bool) -> None:
    """Layers [start, end) of the decoding trunk (multi-token-prediction blocks after it are never in a stage)."""
    writer, tensors, _ = _stage_writer(src, dst, start, end, with_vocab)
    _write_tensors(writer, tensors)


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + nbytes) of a stage file: from the source at src_offset (of its part src_part, for a
    split GGUF), or `data` (src_offset -1)."""
    offset: int
    nbytes: int
    src_offset: int = -1
    data: bytes = b""
    src_part: int = 0


@dataclass(frozen=True)
class StageLayout:
    """Where every byte of a stage file comes from, without writing it: the header (key-values, tensor infos), then
    each tensor's data copied from the source as it is (or a small stand-in), zeros between them (alignment).
    ranks/weights.py streams a stage file to a host that lacks the model from this; the bytes are those
    write_stage_file writes (tests/test_weights.py)."""
    size: int
    pieces: tuple[Piece, ...]

    def read(self, src_fd, offset: int, buf: np.ndarray) -> int:
        """Fill buf (a uint8 array) with the file's bytes from offset; returns how many (the rest of the
        file when shorter). src_fd: the source's open fd, or the fds of a split GGUF's parts in order."""
        fds = (src_fd,) if isinstance(src_fd, int) else tuple(src_fd)
        n = min(len(buf), self.size - offset)
        view = memoryview(buf)[:n]
        pos, end = offset, offset + n  # pos: where the bytes written so far end
        for p in sorted(self.pieces, key=lambda p: p.offset):
            a, b = max(p.offset, offset), min(p.offset + p.nbytes, end)
            if a >= b:
                continue
            if a > pos:
                buf[pos - offset:a - offset] = 0  # the padding between pieces
            pos = max(pos, b)
            if p.src_offset < 0:
                view[a - offset:b - offset] = p.data[a - p.offset:b - p.offset]
            else:
                got = os.preadv(fds[p.src_part], [view[a - offset:b - offset]], p.src_offset + a - p.offset)
                if got != b - a:
                    raise StageFileError(f"short read of the source at {p.src_offset + a - p.offset:,}")
        if pos < end:
            buf[pos - offset:n] = 0
        return n


@dataclass(frozen=True)
class Recipe:
    """How a host assembles a stage file (size bytes): `local` ranges copied from files it already holds (each
    (offset, nbytes, held file's name, offset in that file): a tensor of the source that the held file has as it
    is), every other byte from the wire, in file order. Rank 0 sends only the wire bytes; both sides cut the file
    into the same chunks, so each chunk's message carries that chunk's wire bytes."""
    size: int
    local: tuple[tuple[int, int, str, int], ...] = ()

    def wire(self, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
        """The [a, b) ranges of [lo, hi) that come from the wire, in order."""
        hi = self.size if hi is None else hi
        out, pos = [], lo
        for off, n, _, _ in self.local:
            a, b = max(off, lo), min(off + n, hi)
            if a >= b:
                continue
            if a > pos:
                out.append((pos, a))
            pos = b
        if pos < hi:
            out.append((pos, hi))
        return out

    def wire_bytes(self, lo: int = 0, hi: int | None = None) -> int:
        return sum(b - a for a, b in self.wire(lo, hi))

    def local_in(self, lo: int, hi: int) -> list[tuple[int, int, str, int]]:
        """The local ranges within [lo, hi), clipped: (a, b, held file's name, offset of a in it)."""
        out = []
        for off, n, name, at in self.local:
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                out.append((a, b, name, at + a - off))
        return out

    def pack(self, lo: int, chunk: np.ndarray, out: np.ndarray) -> int:
        """Sender: the wire bytes of the file's bytes chunk (which start at lo) into out, in order; returns how
        many."""
        m = 0
        for a, b in self.wire(lo, lo + len(chunk)):
            out[m:m + b - a] = chunk[a - lo:b - lo]
            m += b - a
        return m

    def unpack(self, lo: int, wire: np.ndarray, held_fds: dict[str, int], out: np.ndarray) -> None:
        """Receiver: the file's bytes [lo, lo + len(out)) into out, from this chunk's wire bytes and the held files
        (name -> open fd)."""
        hi = lo + len(out)
        m = 0
        for a, b in self.wire(lo, hi):
            out[a - lo:b - lo] = wire[m:m + b - a]
            m += b - a
        view = memoryview(out)
        for a, b, name, at in self.local_in(lo, hi):
            if os.preadv(held_fds[name], [view[a - lo:b - lo]], at) != b - a:
                raise StageFileError(f"{name} is shorter than its index says")


def recipe(layout: StageLayout, held: dict[str, StageLayout]) -> Recipe:
    """The Recipe of `layout` for a host holding the files `held` (name -> the layout each was written from, all
    of the same source): a tensor piece whose source bytes a held file has (same source offset and size) is copied
    from there; the header, stand-ins and everything else travel."""
    have = {}
    for name, lay in sorted(held.items()):
        for p in lay.pieces:
            if p.src_offset >= 0:
                have.setdefault((p.src_part, p.src_offset, p.nbytes), (name, p.offset))
    local = []
    for p in layout.pieces:
        if p.src_offset >= 0 and (p.src_part, p.src_offset, p.nbytes) in have:
            name, at = have[(p.src_part, p.src_offset, p.nbytes)]
            local.append((p.offset, p.nbytes, name, at))
    return Recipe(layout.size, tuple(local))


def stage_layout(src, start: int, end: int, with_vocab: bool, reader=None) -> StageLayout:
    """The layout of the stage file for layers [start, end) of src (see StageLayout); reader: src's GGUFReader (or
    HeaderReader), when several layouts are made (parsing a large vocabulary takes seconds)."""
    return _layout(lambda head: _stage_writer(src, head, start, end, with_vocab, reader))


def _layout(make_writer) -> StageLayout:
    """The layout of the file make_writer(path) would write: (writer with its key-values added, its [(name, data,
    type)] tensors, the source's reader)."""
    import tempfile

    import gguf
    with tempfile.TemporaryDirectory(prefix="pipeinfer-layout-") as d:
        head = Path(d) / "header.gguf"
        writer, tensors, reader = make_writer(head)
        for name, data, ttype in tensors:
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, ttype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        align = writer.data_alignment
        writer.close()
        header = head.read_bytes()
    pieces = [Piece(0, len(header), -1, header)]
    pos = len(header)
    parts = [(m.ctypes.data, m.nbytes) for m in (reader.parts if isinstance(reader, HeaderReader) else [reader.data])]
    for _, data, _ in tensors:  # as GGUFWriter.write_tensor_data pads: to the alignment before, by size after
        pos = gguf.GGUFWriter.ggml_pad(pos, align)
        at = data.ctypes.data
        part = next((i for i, (base, n) in enumerate(parts) if base <= at < base + n), None)
        if part is not None:  # raw data of the source, as it is
            pieces.append(Piece(pos, data.nbytes, at - parts[part][0], src_part=part))
        else:
            pieces.append(Piece(pos, data.nbytes, -1, np.ascontiguousarray(data).tobytes()))
        pos += gguf.GGUFWriter.ggml_pad(data.nbytes, align)
    return StageLayout(pos, tuple(pieces))


def vocab_layout(src, reader=None) -> StageLayout:
    """A GGUF with src's key-values and no tensors: what a host that runs only the draft needs of the target
    (read_info, its tokenizer with vocab_only: llama.cpp skips the tensors)."""
    import tempfile
    reader = reader or source_reader(src)
    with tempfile.TemporaryDirectory(prefix="pipeinfer-layout-") as d:
        head = Path(d) / "vocab.gguf"
        writer = _copy_writer(reader, head)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        data = head.read_bytes()
    return StageLayout(len(data), (Piece(0, len(data), -1, data),))


def whole_layout(src, reader=None) -> StageLayout:
    """A file as it is (a draft model that travels whole); a split GGUF as one GGUF of its key-values (less the split
    keys) and every part's tensors, as they are."""
    from .ggufheader import model_files
    if len(model_files(src)) == 1:
        size = os.path.getsize(src)
        return StageLayout(size, (Piece(0, size, 0),))
    reader = reader or HeaderReader(src)
    return _layout(lambda head: (_copy_writer(reader, head), [(t.name, t.data, t.tensor_type)
                                                              for t in reader.tensors], reader))


def _copy_writer(reader, dst):
    """A GGUFWriter to dst with every key-value of reader's source but GGUF's own and a split GGUF's split keys."""
    import gguf
    writer = _writer_for(reader, dst, _field(reader, "general.architecture"))
    for field in reader.fields.values():
        if _not_copied(field.name):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    return writer


def _not_copied(key: str) -> bool:
    """Keys a file written from a source never copies: GGUF's own, the architecture (the writer adds it) and a
    split GGUF's split keys (what pipeinfer writes is one file; llama.cpp would look for its other parts)."""
    from .gguf_parts import SPLIT_KEYS
    return key.startswith("GGUF.") or key == "general.architecture" or key in SPLIT_KEYS


class _RawValue:
    """A key-value's bytes as the source has them (its type tag and value): copied, not decoded and encoded again."""

    def __init__(self, data: bytes):
        self.data = data


class _Field:
    def __init__(self, name: str, types: list, value):
        self.name, self.types, self._value = name, types, value

    def contents(self):
        return self._value


class _Tensor:
    def __init__(self, name: str, tensor_type, shape: tuple, data):
        self.name, self.tensor_type, self.shape, self.data = name, tensor_type, shape, data


class HeaderReader:
    """What _stage_writer reads of a GGUF, from the fast header reader (ggufheader.py) in milliseconds, where
    gguf.GGUFReader builds a numpy view of every vocabulary string (7.8 s for Qwen2.5-1.5B's 151,936 beside the
    other ranks): the architecture's own keys decoded (per-layer arrays included), every other key kept as the
    source's raw bytes, tensors as read-only memmap views shaped as GGUFReader shapes them, from every part of a
    split GGUF (`parts`: one memmap per file, in order; `data`: the first)."""

    def __init__(self, src):
        import gguf

        from .ggufheader import read_header
        arch = read_header(src).fields["general.architecture"]
        first = read_header(src)
        own = SPLIT_RULES[arch].per_layer_keys if arch in SPLIT_RULES else ()  # decoded as the arch's own keys
        keep = tuple(k for k, (vt, _, _) in first.spans.items() if vt == gguf.GGUFValueType.ARRAY
                     and (k.startswith(f"{arch}.") or k in own))
        header = read_header(src, keep_arrays=keep)
        self.parts = [np.memmap(f, dtype=np.uint8, mode="r") for f in header.files]
        self.data = self.parts[0]
        maps = dict(zip(header.files, self.parts))
        self.fields = {}
        for key, value in header.fields.items():
            vtype, a, b = header.spans[key]
            types = [gguf.GGUFValueType(vtype)]
            if vtype == gguf.GGUFValueType.ARRAY:
                types.append(gguf.GGUFValueType(int(self.data[a + 4:a + 8].view("<u4")[0])))
            if key != "general.architecture" and not key.startswith(f"{arch}.") and key not in own:
                value = _RawValue(bytes(self.data[a:b]))
            self.fields[key] = _Field(key, types, value)
        self.tensors = []
        simple = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
                  gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                  gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                  gguf.GGMLQuantizationType.I64: np.int64}
        for t in header.tensors.values():  # as GGUFReader._build_tensors does
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            np_dims = tuple(reversed(t.shape))
            raw = maps[t.file][t.offset:t.offset + t.nbytes]
            if qtype in simple:
                data = raw.view(simple[qtype]).reshape(np_dims)
            else:
                data = raw.reshape(gguf.quant_shape_to_byte_shape(np_dims, qtype))
            self.tensors.append(_Tensor(t.name, qtype, t.shape, data))


def _writer_for(reader, dst, arch: str):
    """A GGUFWriter to dst for what reader reads: one that copies HeaderReader's raw key-values as they are."""
    import gguf
    return (_raw_writer() if isinstance(reader, HeaderReader) else gguf.GGUFWriter)(str(dst), arch)


def _raw_writer():
    """A GGUFWriter that copies _RawValue key-values as they are."""
    import gguf

    class RawWriter(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if isinstance(val, _RawValue):
                return val.data if add_vtype else val.data[4:]
            return super()._pack_val(val, vtype, add_vtype, sub_type)
    return RawWriter


def _stage_writer(src, dst, start: int, end: int, with_vocab: bool, reader=None):
    """(a GGUFWriter to dst with the stage's key-values added, its [(name, data, type)] tensors, the source's
    reader)."""
    import gguf
    reader = reader or source_reader(src)
    arch = _field(reader, "general.architecture")
    n_all = int(_field(reader, f"{arch}.block_count"))
    n_layer = n_all - int(_field(reader, f"{arch}.nextn_predict_layers") or 0)
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    if not (0 <= start < end <= n_layer):
        raise StageFileError(f"layer range [{start}, {end}) outside the model's {n_layer} layers")
    check_splittable(ModelInfo(arch, n_layer, n_embd, 0), 2 if (start, end) != (0, n_layer) else 1)

    writer = _writer_for(reader, dst, arch)
    for name, value, vtype, sub_type in _stage_metadata(reader, arch, n_all, n_layer, start, end, with_vocab):
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    if not with_vocab:
        _add_dummy_vocab(writer, gguf)

    tensors = []  # (new name, data, type)
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if not start <= il < min(end, n_layer):
                continue
            name = f"blk.{il - start}." + name.split(".", 2)[2]
        elif not with_vocab and name in ("token_embd.weight", "output.weight"):
            # [4, n_embd] stand-ins: never used for hidden-state input, projection of 4 rows is free
            tensors.append((name, np.zeros((4, n_embd), dtype=np.float32), gguf.GGMLQuantizationType.F32))
            continue
        elif not with_vocab and name == "output.bias":  # phimoe's bias per vocabulary entry: for the 4 stand-ins
            tensors.append((name, np.zeros(4, dtype=np.float32), gguf.GGMLQuantizationType.F32))
            continue
        tensors.append((name, t.data, t.tensor_type))
    return writer, tensors, reader


def _stage_metadata(reader, arch: str, n_all: int, n_layer: int, start: int, end: int, with_vocab: bool):
    """(key, value, type, array element type) of a stage file: the source's, with the layer count, per-layer
    arrays sliced to the range and every layer-index rule of SPLIT_RULES[arch] written out."""
    import gguf
    rule = SPLIT_RULES.get(arch)
    array = gguf.GGUFValueType.ARRAY
    swa_key = f"{arch}.attention.sliding_window_pattern"
    drop = {f"{arch}.nextn_predict_layers"}  # a stage holds no multi-token-prediction block
    if rule and rule.swa_period:
        drop.add(swa_key)  # written below as the whole model's per-layer pattern, sliced
    if rule and start > 0:
        drop.update(f"{arch}.{k}" for k in rule.first_stage_keys)
    extra = rule.metadata(_metadata_fields(reader, arch), start, end, with_vocab) if rule and rule.metadata else {}
    per_layer_skip = {f"{arch}.{k}" for k in NOT_PER_LAYER}
    for field in reader.fields.values():
        name, vtype = field.name, field.types[0]
        if _not_copied(name) or name in drop or name in extra or (not with_vocab and name.startswith("tokenizer.")):
            continue
        value = field.contents()
        if name == f"{arch}.block_count":
            value = end - start
        elif name == f"{arch}.leading_dense_block_count" and rule and rule.dense_lead:
            value = min(max(int(value) - start, 0), end - start)  # dense FFN layers counted from the stage's start
        elif vtype == array and (name.startswith(f"{arch}.") or (rule and name in rule.per_layer_keys)) \
                and len(value) == n_all and name not in per_layer_skip:
            value = value[start:end]  # per-layer metadata (head counts, window flags, ...)
        yield name, value, vtype, field.types[-1] if vtype == array else None
    for name, (value, vtype) in extra.items():
        yield name, value, vtype, None
    if rule and rule.swa_period:
        yield swa_key, _swa_pattern(reader, swa_key, rule, n_layer)[start:end], array, gguf.GGUFValueType.BOOL


def _swa_pattern(reader, key: str, rule: SplitRule, n_layer: int) -> list[bool]:
    """Windowed (True) or full attention for each layer of the whole model, as llama.cpp's load_swa_pattern
    decides it: the per-layer array if the file has one, else il % period (the file's scalar period, or the
    architecture's), as llama_hparams::set_swa_pattern computes it."""
    value = _field(reader, key)
    if isinstance(value, list):
        return [bool(x) for x in value[:n_layer]]
    period = rule.swa_period if value is None else int(value)
    if period == 0:
        return [True] * n_layer
    return [il % period < period - 1 for il in range(n_layer)]


def _write_tensors(writer, tensors: list) -> None:
    """Finish a GGUFWriter whose key-values are added: header, key-values, tensor infos, then each (name, data,
    type) tensor's raw data, and close it."""
    for name, data, ttype in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(np.ascontiguousarray(data))
    writer.close()


def _add_dummy_vocab(writer, gguf, n: int = 4) -> None:
    # SentencePiece-style ("llama") n-token vocabulary: loads and reports n_vocab = n (the strings are never used)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a"] + [f"<t{i}>" for i in range(4, n)])
    writer.add_token_scores([0.0] * n)
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.NORMAL] * (n - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


# ================================================================ a draft with a pruned output head
PRUNED_FORMAT = 1  # bump when the pruned-head file layout changes


def head_tokens(tokens: list[bytes], token_types: list[int], n_keep: int) -> np.ndarray:
    """The token ids a pruned draft head keeps, at most n_keep (int32, sorted): the most frequent tokens.

    A BPE vocabulary numbers its merged tokens in merge order, i.e. by how often the tokenizer's training
    text made them, and lists its base alphabet (single characters, or bytes) by frequency too; Gemma's
    SentencePiece-converted vocabulary puts the merges first and the 26,000-character alphabet after them.
    So the head keeps: every special token a model may emit (gguf token types UNKNOWN, CONTROL but not the
    `<unused...>` placeholders, USER_DEFINED, BYTE), the n_keep / 16 lowest-id single characters and the
    lowest-id merged tokens up to n_keep: the frequency-ranked draft vocabulary of FR-Spec (Zhao et al.,
    2025) without a corpus of our own."""
    special, chars, merged = [], [], []
    for i, (text, kind) in enumerate(zip(tokens, token_types)):
        if kind == 1:  # NORMAL
            (chars if len(text.decode("utf-8", errors="replace")) == 1 else merged).append(i)
        elif kind in (2, 4, 6) or (kind == 3 and not text.startswith(b"<unused")):
            special.append(i)
    n_chars = min(len(chars), n_keep // 16)
    keep = special[:n_keep] + chars[:n_chars]
    keep += merged[:max(0, n_keep - len(keep))]
    return np.sort(np.array(keep, dtype=np.int32))


def pruned_head_path(src: str | os.PathLike, keep: np.ndarray) -> Path:
    # keyed by the kept ids themselves: a file's rows always match the ids its logits are scattered to
    ids = hashlib.sha256(np.ascontiguousarray(keep, dtype=np.int32).tobytes()).hexdigest()[:16]
    return _derived(src, f"head{len(keep)}", "gguf", ids, PRUNED_FORMAT)


def ensure_pruned_head(src: str | os.PathLike, n_keep: int) -> tuple[Path, np.ndarray]:
    """(path of src with its output head pruned to n_keep tokens, the kept token ids), written on first use."""
    from .ggufheader import read_header
    fields = read_header(src, keep_arrays=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")).fields
    tokens, types = fields.get("tokenizer.ggml.tokens"), fields.get("tokenizer.ggml.token_type")
    if not isinstance(tokens, list) or not isinstance(types, list) or len(types) != len(tokens):
        raise StageFileError(f"{src}: --draft-head needs the GGUF's token list and token types")
    keep = head_tokens(tokens, types, n_keep)
    out = pruned_head_path(src, keep)
    if not out.exists():
        write_atomically(out, lambda tmp: write_pruned_head(src, tmp, keep))
    return out, keep


def write_pruned_head(src, dst, keep: np.ndarray) -> None:
    """src with a vocabulary of len(keep) tokens: the output projection (and the embedding table, which a
    tied model projects with) keeps only rows `keep`, raw data copied as is.

    Only the output head changes: logits row k of the pruned model is logit keep[k] of src, computed by the
    same kernel over the same row. Its input must come as embeddings (stage.TokenEmbedder on src), since
    its own table no longer holds every token; the tokenizer fields become a placeholder vocabulary of
    len(keep) tokens (text goes through src's own tokenizer)."""
    import gguf
    reader = source_reader(src)
    arch = _field(reader, "general.architecture")
    writer = _writer_for(reader, dst, arch)
    for field in reader.fields.values():
        name = field.name
        if _not_copied(name) or name == f"{arch}.vocab_size" or name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
    if f"{arch}.vocab_size" in reader.fields:
        writer.add_key_value(f"{arch}.vocab_size", len(keep), gguf.GGUFValueType.UINT32)
    _add_dummy_vocab(writer, gguf, len(keep))
    _write_tensors(writer, [(t.name, t.data[keep] if t.name in ("token_embd.weight", "output.weight") else t.data,
                             t.tensor_type) for t in reader.tensors])


def vocab_bound(model: str, info) -> int:
    """Token ids on the wire are below this: the vocabulary, or the embedding/output rows when padded beyond it."""
    from .ggufheader import read_header
    rows = [t.shape[1] for name, t in read_header(model).tensors.items()
            if name in ("token_embd.weight", "output.weight") and len(t.shape) == 2]
    return max([info.n_vocab, *rows]) or 2**31 - 1
