"""Math answer reward: 1.0 when the final `\\boxed{}` answer equals the label, else 0.0.

What is scored, in order (each failure gives 0.0 and is counted in `RewardStats`):
1. The text after the LAST `</think>`. A response without `</think>` was cut off while reasoning
   (hit the length limit), so it gets no credit even if a box appears inside the reasoning.
2. The LAST `\\boxed{...}` in that text, braces matched so `\\boxed{\\frac{1}{2}}` is read whole.
   Contents longer than `max_answer_chars` are refused before any parsing (a 200 KB box is an
   attack or a degenerate sample, never an answer).
3. math-verify's equivalence check of that answer against the label (integers, fractions,
   decimals, LaTeX forms such as `\\frac{1}{2}` vs `0.5`, `1,000` vs `1000`, `x=5` vs `5`),
   run in a killable child process with a deadline (see `guard.py`); past the deadline the
   answer scores 0.0 and counts as a timeout.
"""

from __future__ import annotations

import dataclasses
import threading

from infir2_rl.reward.guard import Verdict, VerifyGuard

THINK_END = "</think>"
_BOXED = "\\boxed"
# Unicode minus (U+2212) and similar dashes models copy from web text; math-verify reads only "-".
_MINUS_LOOKALIKES = str.maketrans({"\u2212": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})


@dataclasses.dataclass
class RewardStats:
    """Counts of how answers were scored; every call lands in exactly one outcome bucket."""

    # Calls scored.
    num_calls: int = 0
    # Answers equivalent to the label (reward 1.0).
    num_correct: int = 0
    # Answers parsed and compared but not equivalent.
    num_wrong: int = 0
    # Responses without `</think>` (truncated while reasoning).
    num_missing_think_end: int = 0
    # Responses with no complete `\boxed{...}` after `</think>`.
    num_missing_boxed: int = 0
    # Boxed answers longer than `max_answer_chars`, refused without parsing.
    num_too_long: int = 0
    # Comparisons killed at the deadline.
    num_timeouts: int = 0
    # Comparisons where the math-verify worker failed or died.
    num_errors: int = 0

    def copy(self) -> RewardStats:
        return dataclasses.replace(self)


def extract_final_answer(response: str) -> str | None:
    """The contents of the last `\\boxed{...}` after the last `</think>`, or None.

    Linear in the length of the response, whatever its contents.
    """
    think_end = response.rfind(THINK_END)
    if think_end < 0:
        return None
    return last_boxed(response[think_end + len(THINK_END) :])


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` in `text` with nested braces matched; None if absent or unclosed."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    pos = start + len(_BOXED)
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        return None
    depth = 0
    index = pos
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2  # `\{` and `\}` are literal braces (sets), not grouping
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : index]
        index += 1
    return None


class MathReward:
    """A `RewardFn` for math answers; see the module docstring for what it scores.

    Each instance owns one math-verify child process (started on first use) and its own
    `stats`. Safe to call from several threads (calls are serialized on the child).
    """

    def __init__(self, *, timeout_s: float = 3.0, max_answer_chars: int = 1000) -> None:
        if max_answer_chars < 1:
            raise ValueError(f"max_answer_chars={max_answer_chars}: must be >= 1; use e.g. 1000.")
        self.timeout_s = timeout_s
        self.max_answer_chars = max_answer_chars
        self.stats = RewardStats()
        self._stats_lock = threading.Lock()
        self._guard = VerifyGuard(timeout_s=timeout_s)

    def __call__(self, response: str, label: str) -> float:
        gold = label.strip().translate(_MINUS_LOOKALIKES)
        if not gold:
            raise ValueError("label='': the reward needs a non-empty answer label; drop rows without one.")
        answer = extract_final_answer(response)
        if answer is None:
            outcome = "num_missing_think_end" if THINK_END not in response else "num_missing_boxed"
        elif len(answer) > self.max_answer_chars:
            outcome = "num_too_long"
        else:
            # Labels may arrive boxed already (some datasets store "\\boxed{3}"); box bare ones so
            # math-verify reads both sides with the same LaTeX extractor.
            gold_latex = gold if _BOXED in gold else f"{_BOXED}{{{gold}}}"
            pred_latex = f"{_BOXED}{{{answer.translate(_MINUS_LOOKALIKES)}}}"
            verdict = self._guard.check(pred_latex, gold_latex)
            outcome = {
                Verdict.CORRECT: "num_correct",
                Verdict.WRONG: "num_wrong",
                Verdict.TIMEOUT: "num_timeouts",
                Verdict.ERROR: "num_errors",
            }[verdict]
        with self._stats_lock:
            self.stats.num_calls += 1
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
        return 1.0 if outcome == "num_correct" else 0.0

    def close(self) -> None:
        """Stop the math-verify child process; the next call starts a new one."""
        self._guard.close()

    # Ray and multiprocessing pickle reward functions: ship the settings, not the child process.
    def __getstate__(self) -> dict[str, object]:
        return {"timeout_s": self.timeout_s, "max_answer_chars": self.max_answer_chars}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(**state)  # type: ignore[misc]


_default: MathReward | None = None
_default_lock = threading.Lock()


def _default_reward() -> MathReward:
    global _default
    with _default_lock:
        if _default is None:
            _default = MathReward()
        return _default


def math_reward(response: str, label: str) -> float:
    """1.0 if the last `\\boxed{}` after the last `</think>` in `response` equals `label`, else 0.0.

    Uses a process-wide `MathReward` (3 s deadline per answer); `reward_stats()` reads its counters.
    """
    return _default_reward()(response, label)


def reward_stats() -> RewardStats:
    """A snapshot of the counters of `math_reward` (timeouts, missing `</think>`, ...)."""
    reward = _default_reward()
    with reward._stats_lock:
        return reward.stats.copy()
