"""The project tokenizer: digits, special tokens, chat template, offline reload."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from infir2_rl.models.tokenizer import IM_END, PAD_TOKEN, THINK_END, THINK_START, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


def test_vocab_is_small_and_build_is_deterministic(tmp_path: Path, tokenizer_dir: Path) -> None:
    tok = build_tokenizer(tmp_path)
    assert 256 < len(tok) <= 320
    assert (tmp_path / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


def test_every_digit_is_its_own_token() -> None:
    tok = build_tokenizer()
    for text in ["1234567890", "x=9876+0", "\\boxed{42}", " 77 ", "3.14159"]:
        pieces = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
        digits = [p for p in pieces if any(c.isdigit() for c in p)]
        assert all(len(p) == 1 for p in digits), pieces
        assert len(digits) == sum(c.isdigit() for c in text)


def test_special_tokens_and_think_tags() -> None:
    tok = build_tokenizer()
    assert tok.eos_token == IM_END
    assert tok.pad_token == PAD_TOKEN
    assert tok.eos_token_id != tok.pad_token_id
    for t in ("<|im_start|>", IM_END, PAD_TOKEN, THINK_START, THINK_END):
        assert tok(t, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(t)]
    ids = tok("<think>1+1=2</think> The answer is \\boxed{2}.<|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    # Think tags survive skip_special_tokens (the reward needs </think>); the eos does not.
    assert tok.decode(ids, skip_special_tokens=True) == "<think>1+1=2</think> The answer is \\boxed{2}."


def test_text_round_trips_including_unicode() -> None:
    tok = build_tokenizer()
    text = "Évaluez 3×4 = 12, naïve café 😀\n\tdone"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_chatml_with_generation_prompt() -> None:
    tok = build_tokenizer()
    messages = [{"role": "user", "content": "Compute 2+3."}, {"role": "assistant", "content": "5"}]
    full = tok.apply_chat_template(messages, tokenize=False)
    assert full == "<|im_start|>user\nCompute 2+3.<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nCompute 2+3.<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nCompute 2+3.<|im_end|>\n"


def test_auto_tokenizer_reloads_identically_offline(tokenizer_dir: Path) -> None:
    tok = build_tokenizer()
    loaded = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    text = "<|im_start|>user\nWhat is 12*3?<|im_end|>\n<|im_start|>assistant\n<think>12*3=36</think> é"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert loaded.chat_template == tok.chat_template
