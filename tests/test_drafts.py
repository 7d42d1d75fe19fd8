"""Draft pairings by the target's tokenizer (engine/drafts.py) and `pipeinfer models drafts`."""
import pytest
from click.testing import CliRunner

from pipeinfer.cli.main import main
from pipeinfer.engine.drafts import PAIRINGS, TRANSLATED, Tokenizer, draft_hint, pairing_for
from helpers import real_model


@pytest.mark.parametrize("tok, family", [
    (Tokenizer("llama", "llama-bpe", 128256), "Llama 3.x"),
    (Tokenizer("qwen3moe", "qwen2", 151936), "Qwen3, Qwen3 MoE"),
    (Tokenizer("qwen2", "qwen2", 152064), "Qwen2.5, Qwen2"),
    (Tokenizer("gemma3", "default", 262144), "Gemma 3"),
    (Tokenizer("llama", "default", 32000), "any other"),          # Llama 2's tokenizer is not Llama 3's
    (Tokenizer("deepseek2", "deepseek-v3", 129280), "any other"),
    (Tokenizer("glm4moe", "glm4", 151552), "any other"),
])
def test_a_target_gets_its_familys_draft(tok, family):
    assert pairing_for(tok).family == family


def test_every_pairing_says_where_to_get_its_draft():
    for p in (*PAIRINGS, TRANSLATED):
        assert p.source.startswith(("huggingface.co/", "pipeinfer models fetch ")), p


def test_the_hint_for_the_real_qwen_and_an_unknown_file(tmp_path):
    assert draft_hint(real_model("qwen2.5-coder-1.5b")).startswith(
        "--draft qwen2.5-coder-0.5b (Qwen2.5, Qwen2: Qwen2.5-Coder 0.5B Instruct, the same tokenizer; from pipeinfer "
        "models fetch qwen2.5-coder-0.5b")
    junk = tmp_path / "m.gguf"
    junk.write_bytes(b"x" * 100)
    assert draft_hint(junk).startswith("--draft SMALL.gguf")


def test_models_drafts_prints_the_table_and_a_targets_line():
    res = CliRunner().invoke(main, ["models", "drafts"])
    assert res.exit_code == 0 and "Llama 3.2 1B Instruct" in res.output and res.output.count("\n") == 1 + 6
    res = CliRunner().invoke(main, ["models", "drafts", "gemma3-270m"])
    assert res.exit_code == 0 and res.output.startswith("--draft gemma3-270m (Gemma 3")


@pytest.mark.parametrize("size, draft", [("70b-q4_k_m", "Llama-3.2-1B-Instruct-Q4_K_M.gguf"),
                                         ("70b-q4_0", "gemma3-270m"),   # Llama 2's tokenizer: none of its family
                                         ("32b-q4_k_m", "qwen2.5-coder-0.5b"),
                                         ("235b-a22b-q4_k_m", "Qwen3-0.6B-Q8_0.gguf")])
def test_a_target_named_by_size_gets_the_draft_of_its_tokenizer(size, draft):
    from pipeinfer.cli.plan_cmd import _usual_draft
    assert _usual_draft(None, size) == draft
