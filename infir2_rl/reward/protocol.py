"""The reward-function protocol, loading a reward by name, and batch scoring.

A reward function maps one response (the full decoded text, reasoning included) and the row's
label to a float. Configs name one with `rollout.reward`: `"math"` for the built-in math-verify
reward, or a dotted path to any callable with that signature, `"my_pkg.rewards:exact_match"` or
`"my_pkg.rewards.exact_match"`. A class that needs setup can be named by a factory function.

Two optional methods of a reward object (a ``MathReward`` has both; the built-in ``math_reward`` function gets
its process-wide instance's): ``score_many(responses, labels)`` scores a batch at once (``batch_scorer``),
and ``stats_snapshot()`` returns a ``RewardStats`` whose ``num_timeouts`` / ``num_errors`` the rollout
publishes per step as ``reward/timeouts`` / ``reward/errors`` (``counters``).
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from infir2_rl.reward.math import RewardStats, math_reward, math_reward_many, reward_stats


@runtime_checkable
class RewardFn(Protocol):
    """Score one response against its label; higher is better (the built-in returns 0.0 or 1.0)."""

    def __call__(self, response: str, label: str) -> float: ...


BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward}


def load_reward_fn(spec: str) -> RewardFn:
    """The reward function named by `spec`: a built-in name or "package.module:function" / "package.module.function"."""
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    else:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"rollout.reward={spec!r}: not a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) nor a dotted path; "
            "use 'math' or 'package.module:function'."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"rollout.reward={spec!r}: cannot import module {module_name!r} ({exc}); "
            "install it or put it on PYTHONPATH (with `ray job submit`, inside --working-dir)."
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(
            f"rollout.reward={spec!r}: module {module_name!r} has no attribute {attr!r}; check the name after the colon."
        )
    if not callable(fn):
        raise ValueError(
            f"rollout.reward={spec!r}: {module_name}.{attr} is a {type(fn).__name__}, not a function; "
            "name a callable (response: str, label: str) -> float."
        )
    return fn  # type: ignore[no-any-return]


def batch_scorer(fn: RewardFn) -> Callable[[Sequence[str], Sequence[str]], list[float]] | None:
    """How ``fn`` scores a batch at once, if it can: the built-in's process-wide ``MathReward``, or the
    object's own ``score_many``; None for a plain function (called once per pair)."""
    many = math_reward_many if fn is math_reward else getattr(fn, "score_many", None)
    return many if callable(many) else None


def counters(fn: RewardFn) -> Callable[[], RewardStats] | None:
    """How to read ``fn``'s counters: the built-in's process-wide ones, or the object's own
    ``stats_snapshot``; None for a reward that keeps none."""
    snapshot = reward_stats if fn is math_reward else getattr(fn, "stats_snapshot", None)
    return snapshot if callable(snapshot) else None


def score_batch(fn: RewardFn, responses: Sequence[str], labels: Sequence[str]) -> list[float]:
    """`fn` applied to each (response, label) pair, in order; values are checked to be finite real numbers.

    The built-in math reward (and any object with a ``score_many(responses, labels)`` method, such as a
    ``MathReward``) scores the whole batch at once in parallel worker processes with a per-answer
    deadline. Any other function is called once per pair in this process: it must bound its own time.
    """
    if len(responses) != len(labels):
        raise ValueError(
            f"score_batch got {len(responses)} responses and {len(labels)} labels; pass one label per response."
        )
    many = batch_scorer(fn)
    raw = many(responses, labels) if many is not None else [fn(r, lab) for r, lab in zip(responses, labels)]
    scores: list[float] = []
    for score in raw:
        if not isinstance(score, numbers.Real):
            raise TypeError(
                f"reward function returned {score!r} ({type(score).__name__}); it must return a float."
            )
        # A NaN made its whole group's advantages NaN (max != min counts it as spread), and the update with it.
        if not math.isfinite(score):
            raise ValueError(
                f"reward function returned {score!r} for response {len(scores)} of the batch; it must be finite."
            )
        scores.append(float(score))
    return scores
