"""Wall time of scoring a batch holding answers math-verify never finishes: 1 worker vs N (the same process).

    python bench/reward_deadline.py [--workers 2] [--bad 4] [--good 60] [--deadline 1.0]

Each pathological answer costs its worker one deadline plus a child restart (reward/math.py); with N workers
they are scored side by side. Prints both times and their ratio.
"""

from __future__ import annotations

import argparse
import time

from infir2_rl.reward.math import MathReward

TOWER = "<think>x</think>\\boxed{9^{9^{9^{9}}}}"  # sympy evaluates the tower: never returns
FINE = "<think>x</think>\\boxed{5}"


def timed(workers: int, num_bad: int, num_good: int, deadline: float) -> float:
    reward = MathReward(timeout_s=deadline, num_workers=workers)
    try:
        reward.score_many([FINE] * 2 * workers, ["5"] * 2 * workers)  # start the children first
        start = time.perf_counter()
        scores = reward.score_many([TOWER] * num_bad + [FINE] * num_good, ["5"] * (num_bad + num_good))
        elapsed = time.perf_counter() - start
    finally:
        reward.close()
    assert sum(scores) == num_good and reward.stats.num_timeouts == num_bad
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bad", type=int, default=4)
    parser.add_argument("--good", type=int, default=60)
    parser.add_argument("--deadline", type=float, default=1.0)
    args = parser.parse_args()
    one = timed(1, args.bad, args.good, args.deadline)
    many = timed(args.workers, args.bad, args.good, args.deadline)
    print(
        f"{args.bad} pathological + {args.good} normal answers, deadline {args.deadline} s: 1 worker {one:.2f} s,"
        f" {args.workers} workers {many:.2f} s, ratio {one / many:.2f}x"
    )


if __name__ == "__main__":
    main()
