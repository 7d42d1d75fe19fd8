"""Prepare llama-cpp-python's source for one build that runs on every x86-64 host: ggml's CPU backend built once per
CPU generation (GGML_CPU_ALL_VARIANTS), each host loading the best its CPU supports at run time.

    python3 llama_variants.py SDIST_DIR

- keeps the variants in VARIANTS (the rest are near-duplicates that double the build time on 2 cores); the
  Sapphire Rapids variant is left out because its AMX path crashes on batches of 2+ rows (those hosts load zen4's,
  whose AVX-512 BF16/VNNI/VBMI they have);
- installs each variant's library beside libllama.so (llama-cpp-python's CMakeLists installs only the plain ggml-cpu).
"""
import re
import sys
from pathlib import Path

VARIANTS = ("x64", "sandybridge", "haswell", "skylakex", "icelake", "zen4", "alderlake")


def keep_variants(ggml_cmake: str) -> str:
    """ggml/src/CMakeLists.txt with only VARIANTS among the x86 `ggml_add_cpu_backend_variant(...)` lines."""
    start = ggml_cmake.index('if (GGML_SYSTEM_ARCH STREQUAL "x86")', ggml_cmake.index("if (GGML_CPU_ALL_VARIANTS)"))
    end = ggml_cmake.index("elseif(GGML_SYSTEM_ARCH", start)
    lines = [line for line in ggml_cmake[start:end].splitlines(keepends=True)
             if not (m := re.match(r"\s*ggml_add_cpu_backend_variant\(([\w.]+)", line)) or m.group(1) in VARIANTS]
    return ggml_cmake[:start] + "".join(lines) + ggml_cmake[end:]


def install_variants(top_cmake: str) -> str:
    """llama-cpp-python's CMakeLists.txt installing every variant's library as it installs ggml-cpu's."""
    plain = "llama_cpp_python_install_target(ggml-cpu)"
    assert plain in top_cmake, "llama-cpp-python's CMakeLists.txt no longer installs ggml-cpu by that name"
    extra = "".join(f"\n    llama_cpp_python_install_target(ggml-cpu-{v})" for v in VARIANTS)
    return top_cmake.replace(plain, plain + extra, 1)


def main(sdist: Path) -> None:
    ggml = sdist / "vendor/llama.cpp/ggml/src/CMakeLists.txt"
    top = sdist / "CMakeLists.txt"
    ggml.write_text(keep_variants(ggml.read_text()))
    top.write_text(install_variants(top.read_text()))
    print(f"[image] llama.cpp CPU variants: {', '.join(VARIANTS)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
