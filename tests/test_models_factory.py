"""Model presets, init_model's HF directory, and the offline reload round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from infir2_rl.models.factory import PRESETS, count_parameters, init_model, load_model, preset_config
from infir2_rl.models.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=0)


def test_directory_is_a_standard_hf_checkpoint(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "generation_config.json" in names
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["hidden_size"] % 128 == 0 and config["intermediate_size"] % 128 == 0
    tok = AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id == config["eos_token_id"]
    assert generation["pad_token_id"] == tok.pad_token_id == config["pad_token_id"]
    assert config["vocab_size"] == len(tok)
    text = "<|im_start|>user\nWhat is 12*3?<|im_end|>\n<think>12*3=36</think> \\boxed{36} é"
    assert tok(text)["input_ids"] == build_tokenizer()(text)["input_ids"]


def test_tiny_preset_has_about_one_million_parameters(tiny_dir: Path) -> None:
    model, _ = load_model(tiny_dir)
    assert 0.5e6 < count_parameters(model) < 1.5e6


def test_reload_gives_same_logits_and_chat_template(tiny_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Compute 2+3."}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    # Same seed -> same weights; the saved directory and a fresh init agree exactly.
    again = init_model(tmp_path / "again", "tiny", seed=0)
    model2, _ = load_model(again)
    with torch.no_grad():
        torch.testing.assert_close(model2(input_ids=ids).logits, logits, rtol=0, atol=0)
    other = init_model(tmp_path / "other", "tiny", seed=1)
    model3, _ = load_model(other)
    with torch.no_grad():
        assert not torch.allclose(model3(input_ids=ids).logits, logits)


def test_init_does_not_touch_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    init_model(tmp_path / "m", "tiny", seed=7)
    torch.testing.assert_close(torch.rand(3), expected)


def test_refuses_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="not empty"):
        init_model(tmp_path, "tiny")
    assert (tmp_path / "keep.txt").read_text() == "user data"


def test_unknown_preset_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset='huge'"):
        init_model(tmp_path / "m", "huge")


def test_load_model_rejects_a_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_have_fp8_friendly_shapes(preset: str) -> None:
    config = preset_config(preset, build_tokenizer())
    assert config.hidden_size % 128 == 0 and config.intermediate_size % 128 == 0
    assert config.num_attention_heads % config.num_key_value_heads == 0
    with torch.device("meta"):  # shapes only: no memory for the large presets
        model = Qwen2ForCausalLM(config)
    expected = {
        "tiny": 0.83e6,
        "small": 19e6,
        "100m": 101e6,
        "qwen2.5-1.5b-shape": 1.31e9,
        "qwen2.5-7b-shape": 6.53e9,
    }
    assert count_parameters(model) == pytest.approx(expected[preset], rel=0.02)


def test_real_qwen_shapes() -> None:
    c7 = preset_config("qwen2.5-7b-shape", build_tokenizer())
    assert (c7.hidden_size, c7.intermediate_size, c7.num_hidden_layers) == (3584, 18944, 28)
    assert (c7.num_attention_heads, c7.num_key_value_heads, c7.tie_word_embeddings) == (28, 4, False)
    c15 = preset_config("qwen2.5-1.5b-shape", build_tokenizer())
    assert (c15.hidden_size, c15.intermediate_size, c15.num_attention_heads, c15.num_key_value_heads) == (
        1536,
        8960,
        12,
        2,
    )
