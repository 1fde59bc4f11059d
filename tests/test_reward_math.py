"""Math reward: answer extraction, equivalence through math-verify, the killable guard, reward loading."""

from __future__ import annotations

import pickle
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from infir2_rl.reward import (
    MathReward,
    RewardFn,
    extract_final_answer,
    load_reward_fn,
    math_reward,
    reward_stats,
    score_batch,
)
from infir2_rl.reward.math import last_boxed


def answer(boxed: str, reasoning: str = "let me add the numbers") -> str:
    return f"<think>{reasoning}</think>The answer is \\boxed{{{boxed}}}."


@pytest.fixture(scope="module")
def reward() -> Iterator[MathReward]:
    fn = MathReward(timeout_s=1.0)
    yield fn
    fn.close()


@pytest.mark.parametrize(
    ("boxed", "label"),
    [
        ("42", "42"),
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "0.5"),
        ("\\dfrac{3}{4}", "0.75"),
        ("\u22123", "-3"),  # Unicode minus in the answer
        ("-3", "\u22123"),  # ... and in the label
        ("1,000", "1000"),
        ("3.0", "3"),
        ("x = 5", "5"),
        ("\\text{5}", "5"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\frac{\\sqrt{4}}{2}", "1"),  # nested braces inside the box
        ("7", "\\boxed{7}"),  # labels stored already boxed
    ],
)
def test_equivalent_forms_score_one(reward: MathReward, boxed: str, label: str) -> None:
    assert reward(answer(boxed), label) == 1.0


@pytest.mark.parametrize(
    ("boxed", "label"),
    [("4", "5"), ("0.5", "\\frac{1}{3}"), ("-3", "3"), ("12", "1.2"), ("\\frac{2}{3}", "0.67"), ("x", "5")],
)
def test_wrong_answers_score_zero(reward: MathReward, boxed: str, label: str) -> None:
    assert reward(answer(boxed), label) == 0.0


def test_missing_think_end_scores_zero_even_with_correct_box(reward: MathReward) -> None:
    before = reward.stats.copy()
    assert reward("<think>2+3 is \\boxed{5} so the answer is \\boxed{5}", "5") == 0.0
    assert reward.stats.num_missing_think_end == before.num_missing_think_end + 1


def test_last_box_after_last_think_end_wins(reward: MathReward) -> None:
    several = "<think>try</think>first \\boxed{4}, no wait: \\boxed{5}"
    assert reward(several, "5") == 1.0
    assert reward(several, "4") == 0.0
    # A box inside the reasoning is ignored; only the text after the LAST </think> counts.
    assert reward("<think>\\boxed{5}</think> I am not sure.", "5") == 0.0
    assert reward("<think>a</think>\\boxed{4}<think>b</think>\\boxed{5}", "5") == 1.0
    assert reward("<think>a</think>\\boxed{5}<think>b</think>\\boxed{4}", "5") == 0.0


def test_extraction_handles_nesting_escapes_and_unclosed_boxes() -> None:
    assert extract_final_answer("</think>\\boxed{\\frac{1}{\\sqrt{2}}}") == "\\frac{1}{\\sqrt{2}}"
    assert extract_final_answer("</think>\\boxed {3}") == "3"
    assert last_boxed("\\boxed{\\left\\{1, 2\\right\\}}") == "\\left\\{1, 2\\right\\}"
    assert last_boxed("\\boxed{12") is None  # cut off inside the box
    assert last_boxed("no box here") is None
    assert extract_final_answer("\\boxed{3}") is None  # no </think>


def test_missing_box_counts_and_scores_zero(reward: MathReward) -> None:
    before = reward.stats.copy()
    assert reward("<think>x</think>The answer is 5.", "5") == 0.0
    assert reward("<think>x</think>The answer is \\boxed{5", "5") == 0.0
    assert reward.stats.num_missing_boxed == before.num_missing_boxed + 2


def test_huge_brace_inputs_are_refused_without_parsing(reward: MathReward) -> None:
    before = reward.stats.copy()
    nested = "</think>\\boxed{" + "{" * 100_000 + "1" + "}" * 100_000 + "}"  # ~200 KB, balanced
    assert reward(nested, "1") == 0.0
    assert reward("</think>\\boxed{" + "{" * 200_000, "1") == 0.0  # unbalanced
    assert reward("</think>" + "\\boxed{" * 30_000, "1") == 0.0  # many unclosed boxes
    assert reward.stats.num_too_long == before.num_too_long + 1
    assert reward.stats.num_missing_boxed == before.num_missing_boxed + 2


def test_huge_exponent_times_out_scores_zero_and_worker_recovers(reward: MathReward) -> None:
    # Without the guard, math-verify's verify() never returns on this answer (sympy evaluates the tower).
    before = reward.stats.copy()
    assert reward(answer("9^{9^{9^{9}}}"), "5") == 0.0
    assert reward.stats.num_timeouts == before.num_timeouts + 1
    assert reward(answer("5"), "5") == 1.0  # a fresh worker took over


def test_default_math_reward_counts_outcomes_and_runs_off_the_main_thread() -> None:
    # math-verify's own signal-based timeout raises off the main thread; our guard must not.
    before = reward_stats()
    responses = [answer("5"), answer("6"), "<think>cut off"] * 2
    with ThreadPoolExecutor(max_workers=3) as pool:
        scores = list(pool.map(math_reward, responses, ["5"] * len(responses)))
    assert scores == [1.0, 0.0, 0.0] * 2
    after = reward_stats()
    assert after.num_calls - before.num_calls == 6
    assert after.num_correct - before.num_correct == 2
    assert after.num_wrong - before.num_wrong == 2
    assert after.num_missing_think_end - before.num_missing_think_end == 2


def test_more_calling_threads_than_guards_all_get_scored() -> None:
    # A single answer was verified on the caller's thread; with more callers than guards (2 per worker) the
    # guard deque ran empty and calls raised IndexError ("pop from an empty deque").
    fn = MathReward(timeout_s=3.0, num_workers=1)
    try:
        with ThreadPoolExecutor(max_workers=6) as pool:
            scores = list(pool.map(fn, [answer("3"), answer("4")] * 9, ["3"] * 18))
        assert scores == [1.0, 0.0] * 9
    finally:
        fn.close()


def test_worker_started_by_a_finished_thread_is_replaced_transparently() -> None:
    # On Linux the worker dies with the thread that started it (PR_SET_PDEATHSIG); the next call,
    # from another thread, must start a new worker instead of scoring the answer as an error.
    fn = MathReward(timeout_s=2.0)
    thread = threading.Thread(target=lambda: fn(answer("5"), "5"))
    thread.start()
    thread.join()
    assert fn.stats.num_correct == 1
    assert fn(answer("0.5"), "1/2") == 1.0
    assert (fn.stats.num_correct, fn.stats.num_errors) == (2, 0)
    fn.close()


def test_empty_label_is_a_clear_error(reward: MathReward) -> None:
    with pytest.raises(ValueError, match="label"):
        reward(answer("5"), "  ")


def test_math_reward_pickles_without_its_process() -> None:
    fn = MathReward(timeout_s=2.0, max_answer_chars=50)
    clone = pickle.loads(pickle.dumps(fn))
    assert (clone.timeout_s, clone.max_answer_chars) == (2.0, 50)
    assert clone(answer("5"), "5") == 1.0
    clone.close()


def test_load_reward_fn_builtin_and_dotted_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_reward_fn("math") is math_reward
    assert load_reward_fn("infir2_rl.reward.math:math_reward") is math_reward
    assert load_reward_fn("infir2_rl.reward.math.math_reward") is math_reward
    (tmp_path / "my_rewards_pkg").mkdir()
    (tmp_path / "my_rewards_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_rewards_pkg" / "exact.py").write_text(
        textwrap.dedent(
            """
            def exact_match(response: str, label: str) -> float:
                return 1.0 if response.strip() == label else 0.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("my_rewards_pkg.exact:exact_match", "my_rewards_pkg.exact.exact_match"):
        fn = load_reward_fn(spec)
        assert isinstance(fn, RewardFn)
        assert score_batch(fn, ["7", " 8 ", "9"], ["7", "8", "7"]) == [1.0, 1.0, 0.0]
    sys.modules.pop("my_rewards_pkg.exact", None)
    sys.modules.pop("my_rewards_pkg", None)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_package_xyz.rewards:fn", "cannot import module"),
        ("infir2_rl.reward.math:no_such_fn", "has no attribute"),
        ("infir2_rl.reward.math:THINK_END", "not a function"),
        ("exactmatch", "not a built-in"),
    ],
)
def test_load_reward_fn_errors_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec)


def test_score_batch_checks_lengths_and_return_types(reward: MathReward) -> None:
    assert score_batch(reward, [answer("1"), answer("2")], ["1", "3"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="labels"):
        score_batch(reward, [answer("1")], [])
    with pytest.raises(TypeError, match="float"):
        score_batch(lambda response, label: "1.0", ["a"], ["b"])  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_score_batch_refuses_a_reward_that_is_not_finite(bad: float) -> None:
    # A NaN reward made its whole GRPO group's advantages NaN (max != min counts it as spread), so the
    # step's loss was NaN and the update skipped, every step it recurred, with no word of why.
    with pytest.raises(ValueError, match="response 1 of the batch; it must be finite"):
        score_batch(lambda response, label: bad if response == "b" else 1.0, ["a", "b"], ["x", "x"])
