"""Readers and datasets: jsonl/parquet, bad rows per reason, exact assistant-only loss masks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerFast

from infir2_rl.data.datasets import (
    load_prompt_examples,
    load_sft_examples,
    stop_token_ids,
    tokenize_conversation,
    turn_end_token,
)
from infir2_rl.data.readers import read_records
from infir2_rl.models.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def _chat(q: str, a: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _masked_text(tok: PreTrainedTokenizerFast, ids: list[int], mask: list[int]) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_loss_mask_is_exactly_the_assistant_answer_and_its_eos(tok: PreTrainedTokenizerFast) -> None:
    answer = "<think>23+45=68</think> The answer is \\boxed{68}."
    ids, mask = tokenize_conversation(tok, _chat("Compute 23+45.", answer))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Compute 23+45."}], tokenize=False, add_generation_prompt=True
    )
    num_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    num_answer = len(tok(answer + "<|im_end|>", add_special_tokens=False)["input_ids"])
    # prompt tokens | answer tokens + <|im_end|> | trailing "\n" of the template
    assert mask == [0] * num_prompt + [1] * num_answer + [0]
    assert ids[num_prompt + num_answer - 1] == tok.eos_token_id
    assert _masked_text(tok, ids, mask) == answer + "<|im_end|>"


def test_loss_mask_multi_turn_with_system_prompt(tok: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        *_chat("Compute 1+1.", "2"),
        *_chat("And 2+2?", "é 4"),
    ]
    ids, mask = tokenize_conversation(tok, messages)
    assert len(ids) == len(mask)
    assert _masked_text(tok, ids, mask) == "2<|im_end|>é 4<|im_end|>"
    assert sum(1 for i, m in zip(ids, mask) if m and i == tok.eos_token_id) == 2


def _base_like(eos: str = "<|endoftext|>", template: str | None = None) -> PreTrainedTokenizerFast:
    """Our tokenizer with another eos, as Qwen2.5's base checkpoints name ``<|endoftext|>`` while their ChatML
    template ends each turn with ``<|im_end|>``."""
    tok = build_tokenizer()
    tok.eos_token = eos
    if template is not None:
        tok.chat_template = template
    return tok


def test_a_turn_ends_at_the_templates_token_whatever_the_eos(tok: PreTrainedTokenizerFast) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert turn_end_token(tok) == "<|im_end|>" and stop_token_ids(tok) == [im_end]  # our tokenizer: eos too
    base = _base_like()
    endoftext = base.convert_tokens_to_ids("<|endoftext|>")
    assert base.eos_token_id == endoftext != im_end
    # Before, generation stopped at eos alone, which this template never writes: every response ran on.
    assert turn_end_token(base) == "<|im_end|>" and stop_token_ids(base) == [im_end, endoftext]
    answer = "The answer is \\boxed{4}."
    ids, mask = tokenize_conversation(base, _chat("2+2?", answer))
    assert ids == tokenize_conversation(tok, _chat("2+2?", answer))[0]
    # The same mask as with eos = <|im_end|>: the turn's end is learned, the newline after it is not.
    assert mask == tokenize_conversation(tok, _chat("2+2?", answer))[1]
    assert _masked_text(base, ids, mask) == answer + "<|im_end|>"


def test_a_template_with_no_turn_end_token_stops_at_eos() -> None:
    plain = _base_like(
        template="{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
    )
    assert turn_end_token(plain) is None
    assert stop_token_ids(plain) == [plain.convert_tokens_to_ids("<|endoftext|>")]
    plain.eos_token = None
    with pytest.raises(ValueError, match="nothing to stop generation at"):
        stop_token_ids(plain)


def test_sft_bad_rows_are_counted_per_reason_and_logged(
    tok: PreTrainedTokenizerFast, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = json.dumps({"conv": _chat("Compute 1+2.", "<think>1+2=3</think> \\boxed{3}")})
    lines = [
        good,
        "{not json",
        "[1, 2]",  # valid JSON but not an object
        json.dumps({"messages": _chat("q", "a")}),  # wrong key for messages_key="conv"
        json.dumps({"conv": "just a string"}),
        json.dumps({"conv": [{"role": "user", "content": "no answer"}]}),
        json.dumps({"conv": _chat("Compute 1+2.", "   ")}),
        json.dumps({"conv": _chat("Compute " + "1+" * 200 + "1.", "x")}),
        "",  # blank lines are not rows
        good,
    ]
    path = _write_jsonl(tmp_path / "sft.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="infir2_rl.data.datasets"):
        examples, report = load_sft_examples(path, tok, messages_key="conv", max_seq_len=128)
    assert len(examples) == report.num_kept == 2
    assert (report.num_rows, report.num_skipped) == (9, 7)
    assert (report.invalid_json, report.missing_key, report.bad_format) == (2, 1, 2)
    assert (report.empty_text, report.too_long) == (1, 1)
    assert "row 2: invalid_json" in caplog.text and "too_long" in caplog.text
    assert "kept 2 of 9 rows" in caplog.text


def test_prompt_rows_chat_list_or_plain_string(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    lines = [
        json.dumps({"q": [{"role": "user", "content": "Compute 2+3."}], "ans": "5"}),
        json.dumps({"q": "Compute 2+3.", "ans": 5}),
        json.dumps({"q": "Compute 2+3."}),  # no label
        json.dumps({"q": "   ", "ans": "1"}),
        json.dumps({"q": "Compute 2+3.", "ans": ""}),
        json.dumps({"q": [{"role": "user"}], "ans": "1"}),
        json.dumps({"q": "Compute " + "9+" * 100 + "9.", "ans": "1"}),
        "{",
    ]
    path = _write_jsonl(tmp_path / "rl.jsonl", lines)
    examples, report = load_prompt_examples(path, tok, input_key="q", label_key="ans", max_prompt_tokens=64)
    assert [e.label for e in examples] == ["5", "5"]
    assert examples[0].prompt_ids == examples[1].prompt_ids
    assert examples[0].prompt_text.endswith("<|im_start|>assistant\n")
    assert tok(examples[0].prompt_text, add_special_tokens=False)["input_ids"] == examples[0].prompt_ids
    assert (
        report.missing_key,
        report.empty_text,
        report.bad_format,
        report.too_long,
        report.invalid_json,
    ) == (
        1,
        2,
        1,
        1,
        1,
    )


def test_parquet_reads_both_shapes(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    sft = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": _chat("Compute 1+1.", "2")}] * 3), sft)
    examples, report = load_sft_examples(sft, tok)
    assert report.num_kept == 3
    assert _masked_text(tok, examples[0].input_ids, examples[0].loss_mask) == "2<|im_end|>"
    rl = tmp_path / "rl.parquet"
    rows = [
        {"prompt": [{"role": "user", "content": "Compute 1+1."}], "label": "2"},
        {"prompt": None, "label": "3"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), rl)
    prompts, report = load_prompt_examples(rl, tok)
    assert [p.label for p in prompts] == ["2"] and report.missing_key == 1
    assert [r.data for r in read_records(rl)][0] == rows[0]


def test_file_without_usable_rows_names_file_and_counts(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match=r"empty\.jsonl: no usable SFT row out of 0"):
        load_sft_examples(empty, tok)
    bad = _write_jsonl(tmp_path / "bad.jsonl", ["{", json.dumps({"x": 1})])
    with pytest.raises(ValueError, match=r"bad\.jsonl.*invalid_json=1, missing_key=1"):
        load_prompt_examples(bad, tok)


def test_unknown_extension_and_missing_file_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="extension '.csv'"):
        read_records(tmp_path / "data.csv")
    with pytest.raises(ValueError, match="does not exist"):
        read_records(tmp_path / "nope.jsonl")
    rows = list(read_records(_write_jsonl(tmp_path / "x.data", ['{"a": 1}']), format="jsonl"))
    assert rows[0].data == {"a": 1} and rows[0].row == 1


def test_loss_mask_when_the_assistant_speaks_first(tok: PreTrainedTokenizerFast) -> None:
    ids, mask = tokenize_conversation(tok, [{"role": "assistant", "content": "Hi."}, *_chat("1+1?", "2")])
    assert _masked_text(tok, ids, mask) == "Hi.<|im_end|>2<|im_end|>"


def test_template_that_rewrites_earlier_turns_is_skipped_as_bad_format(tmp_path: Path) -> None:
    tok = build_tokenizer()
    # Like templates that strip reasoning from earlier turns: history renders differently from the last turn.
    tok.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if m['role'] == 'assistant' and not loop.last %}...{% else %}{{- m['content'] }}{% endif %}"
        "{{- '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    rows = [{"messages": _chat("1+1?", "2")}, {"messages": [*_chat("1+1?", "2"), *_chat("2+2?", "4")]}]
    path = _write_jsonl(tmp_path / "t.jsonl", [json.dumps(r) for r in rows])
    examples, report = load_sft_examples(path, tok)
    assert (report.num_kept, report.bad_format) == (1, 1)
    assert _masked_text(tok, examples[0].input_ids, examples[0].loss_mask) == "2<|im_end|>"
