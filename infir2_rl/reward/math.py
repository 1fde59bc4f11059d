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

Parallel scoring. A `MathReward` runs `num_workers` threads over 2 x `num_workers` such child
processes (the spares let a thread move on while a killed child's replacement starts), all started
at once on first use; `score_many` spreads a batch's answers over them (the pure-Python steps 1-2 run
first, so only answers that reach math-verify use a child). An answer that hits the deadline costs its
thread one deadline; its child's restart (about 1 s of CPU: an interpreter importing sympy) overlaps
with the other answers. So p pathological answers in a batch cost about ceil(p / num_workers)
deadlines of wall time instead of p: a batch whose every worker meets one costs about one deadline.
Before, 256 of them scored one at a time with a 3 s deadline took 13 minutes. Back-to-back batches
with more than 2 x `num_workers` timeouts wait for restarts as well.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

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


def default_num_workers() -> int:
    """math-verify children per reward: the CPUs this process may use, at most 8 (about 150 MB each)."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, min(8, cpus))


class MathReward:
    """A `RewardFn` for math answers; see the module docstring for what it scores.

    Each instance owns `num_workers` math-verify child processes (started on first use) and its own
    `stats`. Safe to call from several threads; `score_many` scores a batch in parallel.
    """

    def __init__(
        self, *, timeout_s: float = 3.0, max_answer_chars: int = 1000, num_workers: int | None = None
    ) -> None:
        if max_answer_chars < 1:
            raise ValueError(f"max_answer_chars={max_answer_chars}: must be >= 1; use e.g. 1000.")
        num_workers = default_num_workers() if num_workers is None else num_workers
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: must be >= 1 math-verify processes.")
        self.timeout_s = timeout_s
        self.max_answer_chars = max_answer_chars
        self.num_workers = num_workers
        self.stats = RewardStats()
        self._stats_lock = threading.Lock()
        # Twice as many guards as threads: after a timeout, a thread moves on to a ready child while the
        # killed one's replacement starts (guard.py). Ready guards are taken first (right end), restarting
        # ones wait at the left end, so a spare's child is only started when a timeout needs it.
        self._all_guards = [VerifyGuard(timeout_s=timeout_s) for _ in range(2 * num_workers)]
        self._guards = collections.deque(self._all_guards)
        self._guards_lock = threading.Lock()
        # Long-lived threads: a child dies with the thread that started it (PR_SET_PDEATHSIG).
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def __call__(self, response: str, label: str) -> float:
        return self.score_many([response], [label])[0]

    def stats_snapshot(self) -> RewardStats:
        """A copy of this reward's counters (the reward protocol's ``stats_snapshot``: the rollout publishes
        what its timeouts and errors gained during a step)."""
        with self._stats_lock:
            return self.stats.copy()

    def score_many(self, responses: Sequence[str], labels: Sequence[str]) -> list[float]:
        """Scores of (response, label) pairs, in order; math-verify runs on `num_workers` children at once."""
        if len(responses) != len(labels):
            raise ValueError(
                f"score_many got {len(responses)} responses and {len(labels)} labels; pass one label each."
            )
        outcomes: list[str | None] = []
        pending: list[tuple[int, str, str]] = []
        for i, (response, label) in enumerate(zip(responses, labels)):
            outcome, latex = self._pre_check(response, label)
            outcomes.append(outcome)
            if latex is not None:
                pending.append((i, *latex))
        # Always on the pool, whose num_workers threads are what keeps a guard free for each (a single answer
        # verified on the caller's thread let concurrent callers empty the deque: IndexError).
        if pending:
            futures = [(i, self._executor().submit(self._verify, p, g)) for i, p, g in pending]
            for i, future in futures:
                outcomes[i] = future.result()
        with self._stats_lock:
            for outcome in outcomes:
                assert outcome is not None
                self.stats.num_calls += 1
                setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
        return [1.0 if outcome == "num_correct" else 0.0 for outcome in outcomes]

    def _pre_check(self, response: str, label: str) -> tuple[str | None, tuple[str, str] | None]:
        """(outcome, None) when no comparison is needed, else (None, (pred_latex, gold_latex))."""
        gold = label.strip().translate(_MINUS_LOOKALIKES)
        if not gold:
            raise ValueError("label='': the reward needs a non-empty answer label; drop rows without one.")
        answer = extract_final_answer(response)
        if answer is None:
            return ("num_missing_think_end" if THINK_END not in response else "num_missing_boxed"), None
        if len(answer) > self.max_answer_chars:
            return "num_too_long", None
        # Labels may arrive boxed already (some datasets store "\\boxed{3}"); box bare ones so
        # math-verify reads both sides with the same LaTeX extractor.
        gold_latex = gold if _BOXED in gold else f"{_BOXED}{{{gold}}}"
        return None, (f"{_BOXED}{{{answer.translate(_MINUS_LOOKALIKES)}}}", gold_latex)

    def _verify(self, pred_latex: str, gold_latex: str) -> str:
        with self._guards_lock:  # never empty: twice as many guards as pool threads (the only callers)
            guard = self._guards.pop()
        try:
            verdict = guard.check(pred_latex, gold_latex)
        finally:
            with self._guards_lock:
                (self._guards.append if guard.ready else self._guards.appendleft)(guard)
        return {
            Verdict.CORRECT: "num_correct",
            Verdict.WRONG: "num_wrong",
            Verdict.TIMEOUT: "num_timeouts",
            Verdict.ERROR: "num_errors",
        }[verdict]

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="math-verify")
                for guard in self._all_guards:  # boot every child at once, not one per first use
                    self._pool.submit(guard.start_soon).result()
            return self._pool

    def close(self) -> None:
        """Stop the math-verify child processes and threads; the next call starts new ones."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        for guard in self._all_guards:
            guard.close()

    # Ray and multiprocessing pickle reward functions: ship the settings, not the child processes.
    def __getstate__(self) -> dict[str, object]:
        return {
            "timeout_s": self.timeout_s,
            "max_answer_chars": self.max_answer_chars,
            "num_workers": self.num_workers,
        }

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


def math_reward_many(responses: Sequence[str], labels: Sequence[str]) -> list[float]:
    """`math_reward` over a batch, in parallel worker processes (`MathReward.score_many`)."""
    return _default_reward().score_many(responses, labels)


def math_reward(response: str, label: str) -> float:
    """1.0 if the last `\\boxed{}` after the last `</think>` in `response` equals `label`, else 0.0.

    Uses a process-wide `MathReward` (3 s deadline per answer); `reward_stats()` reads its counters.
    """
    return _default_reward()(response, label)


def reward_stats() -> RewardStats:
    """A snapshot of the counters of `math_reward` (timeouts, missing `</think>`, ...)."""
    return _default_reward().stats_snapshot()
