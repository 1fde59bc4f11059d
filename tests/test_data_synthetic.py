"""Synthetic math data: determinism, shapes, verifiable answers, held-out split."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from infir2_rl.data.synthetic import make_data, make_problem

FILES = ("sft_train.jsonl", "sft_test.jsonl", "rl_train.jsonl", "rl_test.jsonl")
SMALL = {"num_sft": 200, "num_rl": 100, "num_test": 50}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_bytes_different_seed_differs(tmp_path: Path) -> None:
    make_data(tmp_path / "a", seed=3, **SMALL)
    make_data(tmp_path / "b", seed=3, **SMALL)
    make_data(tmp_path / "c", seed=4, **SMALL)
    for name in FILES:
        a = (tmp_path / "a" / name).read_bytes()
        assert a == (tmp_path / "b" / name).read_bytes()
        assert a != (tmp_path / "c" / name).read_bytes()


def test_shapes_counts_and_answers(tmp_path: Path) -> None:
    paths = make_data(tmp_path, seed=0, **SMALL)
    sft, rl = _rows(paths.sft_train), _rows(paths.rl_train)
    assert (len(sft), len(rl), len(_rows(paths.sft_test)), len(_rows(paths.rl_test))) == (200, 100, 50, 50)
    for row in sft:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        m = re.fullmatch(r"<think>(.+)</think> The answer is \\boxed\{(\d+)\}\.", assistant["content"], re.S)
        assert m, assistant["content"]
        # The boxed answer is the value of the question's expression and the last worked line.
        expr = re.search(r"[\d+\-*]+\d", user["content"]).group(0)  # type: ignore[union-attr]
        assert eval(expr) == int(m.group(2))  # noqa: S307 - digits and + - * only
        assert m.group(1).splitlines()[-1].endswith("=" + m.group(2))
    for row in rl:
        assert set(row) == {"prompt", "label"}
        assert row["prompt"][0]["role"] == "user" and row["label"].isdigit()


def _expression(question: str) -> str:
    return re.search(r"[\d+\-*]+\d", question).group(0)  # type: ignore[union-attr]


def test_test_set_is_held_out_and_shared_by_sft_and_rl(tmp_path: Path) -> None:
    # The default sizes: with 20,000 SFT rows, a check keyed on the question let about half of the 500 test
    # problems into training in another wording ("What is 1*7?" held out, "Compute 1*7." trained on).
    paths = make_data(tmp_path, seed=0)
    test_q = [r["messages"][0]["content"] for r in _rows(paths.sft_test)]
    assert test_q == [r["prompt"][0]["content"] for r in _rows(paths.rl_test)]
    train = {_expression(r["messages"][0]["content"]) for r in _rows(paths.sft_train)}
    train |= {_expression(r["prompt"][0]["content"]) for r in _rows(paths.rl_train)}
    test = [_expression(q) for q in test_q]
    assert not train & set(test)
    assert len(set(test)) == len(test)


@pytest.mark.parametrize(("steps", "digits"), [(1, 1), (3, 2), (4, 3)])
def test_difficulty_knob(steps: int, digits: int) -> None:
    rng = random.Random(0)
    for _ in range(200):
        p = make_problem(rng, num_steps=steps, num_digits=digits)
        assert len(p.work_lines) == steps
        operands = re.findall(r"\d+", p.question)
        assert len(operands) == steps + 1
        assert max(len(o) for o in operands) <= digits
        assert p.answer >= 0


def test_impossible_request_is_a_clear_error(tmp_path: Path) -> None:
    # 1-step, 1-digit problems: far fewer than 10,000 distinct questions exist.
    with pytest.raises(ValueError, match="distinct problems"):
        make_data(tmp_path, num_sft=10_000, num_rl=10, num_test=10, max_steps=1, max_digits=1)
    with pytest.raises(ValueError, match="distinct problems"):  # 500 questions, but not 500 expressions
        make_data(tmp_path, num_sft=10, num_rl=10, num_test=500, max_steps=1, max_digits=1)
    with pytest.raises(ValueError, match="num_test=0"):
        make_data(tmp_path, num_test=0)
