"""docs/architectures.md's table of every architecture the vendored llama.cpp runs (llama-arch.cpp's LLM_ARCH names,
llama-cpp-python 0.3.36), each with its status in pipeinfer: split (stagefile.SPLIT_RULES, with the rule that needed
care), refused (stagefile.NOT_SPLITTABLE, with the rule that stops it) or not verified (refused on several ranks
too, runs on one), sorted by how many parameters the largest open model of the architecture has (the hand-kept
LARGEST below: approximate, from the model cards; where we know of no model, the largest size llama.cpp's own type
names give). Re-run it after a change to the split rules; tests/test_docs.py fails when the page differs.

    python launch/docgen/architectures_table.py            # rewrite the table in docs/architectures.md
    python launch/docgen/architectures_table.py --check    # exit 1 if the page's table is not what the rules give
    python launch/docgen/architectures_table.py --source DIR   # also check LARGEST against DIR/src/llama-arch.cpp
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, on_path  # noqa: E402

on_path()
from pipeinfer.engine.stagefile import NOT_SPLITTABLE, SPLIT_RULES  # noqa: E402

PAGE = ROOT / "docs" / "architectures.md"
BEGIN = "<!-- architectures table: written by launch/docgen/architectures_table.py -->"
END = "<!-- end of the architectures table -->"

# general.architecture -> (its largest open model, billions of parameters; None: no open model we know the size of)
LARGEST: dict[str, tuple[str, float | None]] = {
    "afmoe": ("Arcee Trinity Mini", 26), "apertus": ("Apertus 70B", 70), "arcee": ("Arcee AFM-4.5B", 4.5),
    "arctic": ("Snowflake Arctic", 480), "arwkv7": ("ARWKV-7 (llama.cpp: 14B)", 14),
    "baichuan": ("Baichuan 2 13B", 13), "bailingmoe": ("Ling-Plus", 290), "bailingmoe2": ("Ling-1T", 1000),
    "bailingmoe3": ("llama.cpp: 124B-A5.1B", 124), "bert": ("BERT large", 0.34), "bitnet": ("BitNet b1.58 2B4T", 2.4),
    "bloom": ("BLOOM", 176), "chameleon": ("Chameleon 34B", 34), "chatglm": ("GLM-4-9B", 9.4),
    "clip": ("a vision encoder, no text model", None), "codeshell": ("CodeShell 7B", 7.9),
    "cogvlm": ("CogVLM 17B", 17), "cohere2": ("Command A", 111), "cohere2moe": ("llama.cpp: 30B-A3B", 30),
    "command-r": ("Command R+", 104), "dbrx": ("DBRX", 132), "deci": ("Llama-3.1-Nemotron-Ultra-253B", 253),
    "deepseek": ("DeepSeek-MoE 16B", 16.4), "deepseek2": ("Kimi K2 (DeepSeek-V3 layout)", 1040),
    "deepseek2-ocr": ("DeepSeek-OCR", 3), "deepseek32": ("DeepSeek-V3.2", 685), "deepseek4": ("DeepSeek-V4", None),
    "dflash": ("DFlash draft heads", None), "dots1": ("dots.llm1", 142), "dots3note": ("llama.cpp: 288B-A19B", 288),
    "dream": ("Dream 7B", 7.6), "eagle3": ("EAGLE-3 draft heads", None), "ernie4_5": ("ERNIE-4.5-0.3B", 0.36),
    "ernie4_5-moe": ("ERNIE-4.5-300B-A47B", 300), "eurobert": ("EuroBERT 2.1B", 2.1),
    "exaone": ("EXAONE 3.5 32B", 32), "exaone-moe": ("llama.cpp: 235B-A22B", 235), "exaone4": ("EXAONE 4.0 32B", 32),
    "falcon": ("Falcon 180B", 180), "falcon-h1": ("Falcon-H1 34B", 34), "gemma": ("Gemma 7B", 8.5),
    "gemma-embedding": ("EmbeddingGemma", 0.3), "gemma2": ("Gemma 2 27B", 27), "gemma3": ("Gemma 3 27B", 27),
    "gemma3n": ("Gemma 3n E4B", 8), "gemma4": ("llama.cpp: Gemma 4 31B", 31),
    "gemma4-assistant": ("Gemma 4 assistant head", None), "glm-dsa": ("GLM-5 (llama.cpp: 744B-A40B)", 744),
    "glm4": ("GLM-4-32B", 32), "glm4moe": ("GLM-4.5/4.6/4.7", 355), "glm5-next": ("llama.cpp: 320B-A18B", 320),
    "gpt-oss": ("gpt-oss-120b", 117), "gpt2": ("GPT-2 XL", 1.5), "gptj": ("GPT-J 6B", 6),
    "gptneox": ("GPT-NeoX-20B", 20), "granite": ("llama.cpp: Granite 30B", 30),
    "granite_swa": ("llama.cpp: Granite 3B", 3), "granitehybrid": ("Granite 4.0 H Small", 32),
    "granitemoe": ("Granite 3.1 3B-A800M", 3.3), "graniteswitch": ("llama.cpp: Granite 30B", 30),
    "grok": ("Grok-1", 314), "grovemoe": ("GroveMoE 33B-A3B", 33), "hrm_text": ("llama.cpp: 1B", 1),
    "hunyuan-dense": ("Hunyuan-7B", 7.5), "hunyuan-moe": ("Hunyuan-A13B", 80), "hunyuan_vl": ("llama.cpp: 7B", 7),
    "hy_v3": ("llama.cpp: 30B-A3B", 30), "hy_v4": ("Hunyuan V4", None), "internlm2": ("InternLM2 20B", 20),
    "jais": ("Jais 30B", 30), "jais2": ("llama.cpp: Jais 2 70B", 70), "jamba": ("Jamba 1.5 Large", 398),
    "jina-bert-v2": ("jina-embeddings-v2-base", 0.14), "jina-bert-v3": ("jina-embeddings-v3", 0.57),
    "kimi-k3": ("llama.cpp: Kimi K3 2.8T-A50B", 2800), "kimi-linear": ("Kimi Linear 48B-A3B", 48),
    "laguna": ("llama.cpp: 230B-A10B", 230), "lfm2": ("LFM2-2.6B", 2.6), "lfm2moe": ("LFM2-24B-A2B", 24),
    "llada": ("LLaDA 8B", 8), "llada-moe": ("LLaDA-MoE 7B-A1B", 7), "llama": ("Llama 3.1 405B", 405),
    "llama-embed": ("an embedding llama", None), "llama4": ("Llama 4 Maverick", 400), "maincoder": ("Maincoder 1B", 1),
    "mamba": ("Mamba 2.8B", 2.8), "mamba2": ("Mamba-Codestral 7B", 7.3), "maple": ("llama.cpp: 20B", 20),
    "mellum": ("llama.cpp: 12B-A2.5B", 12), "mimo2": ("MiMo-V2-Flash", 310), "minicpm": ("MiniCPM4 8B", 8),
    "minicpm3": ("MiniCPM3 4B", 4), "minimax-01": ("MiniMax-Text-01", 456), "minimax-m2": ("MiniMax-M2", 230),
    "minimax-m3": ("llama.cpp: MiniMax-M3 428B-A23B", 428), "mistral3": ("Ministral 3 14B", 14),
    "mistral4": ("Mistral 4", None), "modern-bert": ("ModernBERT large", 0.4), "mpt": ("MPT-30B", 30),
    "muse-glimmer": ("llama.cpp: 30B", 30), "nanbeige": ("Nanbeige", None), "nemotron": ("Nemotron-Mini-4B", 4),
    "nemotron_h": ("Nemotron 3 (llama.cpp: 120B-A12B)", 120), "nemotron_h_moe": ("Nemotron-H MoE", None),
    "neo-bert": ("NeoBERT", 0.25), "nomic-bert": ("nomic-embed-text-v1.5", 0.14),
    "nomic-bert-moe": ("nomic-embed-text-v2-moe", 0.48), "olmo": ("OLMo 7B", 7), "olmo2": ("OLMo 2 32B", 32),
    "olmoe": ("OLMoE-1B-7B", 6.9), "openelm": ("OpenELM 3B", 3), "orion": ("Orion 14B", 14),
    "paddleocr": ("PaddleOCR-VL", 0.9), "pangu-embedded": ("openPangu-Embedded-7B", 7), "phi2": ("Phi-2", 2.7),
    "phi3": ("Phi-4", 14.7), "phimoe": ("Phi-3.5-MoE", 41.9), "plamo": ("PLaMo 13B", 13), "plamo2": ("PLaMo 2 8B", 8),
    "plamo3": ("llama.cpp: PLaMo 3 2B", 2), "plm": ("PLM 1.8B", 1.8), "pockettts": ("Pocket TTS", 0.34),
    "qwen": ("Qwen 72B", 72), "qwen2": ("Qwen2.5 72B", 72.7), "qwen2moe": ("Qwen2-57B-A14B", 57),
    "qwen2vl": ("Qwen2.5-VL 72B", 72), "qwen3": ("Qwen3 32B", 32.8), "qwen35": ("Qwen3.5 27B", 27),
    "qwen35moe": ("Qwen3.5 397B-A17B", 397), "qwen3moe": ("Qwen3-235B-A22B", 235), "qwen3next": ("Qwen3-Next 80B", 80),
    "qwen3tts": ("Qwen3-TTS", None), "qwen3vl": ("Qwen3-VL 32B", 32), "qwen3vlmoe": ("Qwen3-VL-235B-A22B", 235),
    "qwen4exp": ("Qwen4 (experimental)", None), "refact": ("Refact 1.6B", 1.6), "rnd1": ("RND1 30B-A3B", 30),
    "rwkv6": ("RWKV-6 14B", 14), "rwkv6qwen2": ("QRWKV6 32B", 32), "rwkv7": ("RWKV-7 14B", 14),
    "seed_oss": ("Seed-OSS-36B", 36), "smallthinker": ("SmallThinker 21B-A3B", 21), "smollm3": ("SmolLM3 3B", 3),
    "spark2_5": ("llama.cpp: 1.7B", 1.7), "stablelm": ("StableLM 2 12B", 12), "starcoder": ("StarCoder 15.5B", 15.5),
    "starcoder2": ("Granite 34B Code (StarCoder2 layout)", 34), "step35": ("Step 3.5 Flash", 196),
    "t5": ("T5 11B", 11), "t5encoder": ("T5 11B's encoder", 5), "talkie": ("llama.cpp: 13B", 13),
    "wavtokenizer-dec": ("WavTokenizer", 0.08), "xverse": ("XVERSE-65B", 65),
}


def vendored_names(src: Path) -> list[str]:
    """The LLM_ARCH names in llama.cpp's src/llama-arch.cpp (its `(unknown)` placeholder left out)."""
    text = (src / "llama-arch.cpp").read_text()
    return [n for n in re.findall(r'\{\s*LLM_ARCH_[A-Z0-9_]+,\s*"([^"]+)"\s*\}', text) if n != "(unknown)"]


def _size(b: float | None) -> str:
    if b is None:
        return "?"
    if b >= 1000:
        return f"{b / 1000:g}T"
    return f"{b:g}B" if b >= 1 else f"{b * 1000:g}M"


def table() -> str:
    """The Markdown table, largest models first (unknown sizes last), ties by name."""
    rows = sorted(LARGEST.items(), key=lambda kv: (kv[1][1] is None, -(kv[1][1] or 0), kv[0]))
    out = ["| architecture | largest open model | parameters | status | rule |", "|---|---|---|---|---|"]
    for arch, (model, size) in rows:
        if arch in SPLIT_RULES:
            status, rule = "split", SPLIT_RULES[arch].care
        elif arch in NOT_SPLITTABLE:
            status, rule = "refused", NOT_SPLITTABLE[arch]
        else:
            status, rule = "not verified", ""
        out.append(f"| `{arch}` | {model} | {_size(size)} | {status} | {rule.replace('|', '&#124;')} |")
    return "\n".join(out) + "\n"


def page(text: str) -> str:
    """text (docs/architectures.md) with the table between its markers replaced by today's."""
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:a] + "\n" + table() + text[b:]


if __name__ == "__main__":
    args = sys.argv[1:]
    missing = set(SPLIT_RULES) | set(NOT_SPLITTABLE)
    missing -= set(LARGEST)
    if missing:
        sys.exit(f"LARGEST lacks {', '.join(sorted(missing))}: add their largest open models")
    if "--source" in args:
        names = set(vendored_names(Path(args[args.index("--source") + 1]) / "src"))
        if names != set(LARGEST):
            sys.exit(f"LARGEST differs from llama-arch.cpp: missing {sorted(names - set(LARGEST))}, "
                     f"not there {sorted(set(LARGEST) - names)}")
    text = PAGE.read_text()
    if "--check" in args:
        if page(text) != text:
            sys.exit("docs/architectures.md's table is out of date: python launch/docgen/architectures_table.py")
    else:
        PAGE.write_text(page(text))
