"""Rollout manager without Ray: grouping, dynamic sampling, shortfall filling, metrics, token batches, prompt cursor."""

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from infir2_rl.config.components import RolloutConfig
from infir2_rl.metrics import names
from infir2_rl.rollout.batch import RolloutBatch, to_token_batches
from infir2_rl.rollout.manager import RolloutManager
from infir2_rl.rollout.prompts import PromptSource
from infir2_rl.types import GenerateRequest, Sample


@dataclass(frozen=True)
class Prompt:
    prompt_ids: list[int]
    label: str


class ScriptedEngine:
    """Sample i of a prompt answers "1" (correct) when i < prompt_ids[0], else "0"; truncated when prompt_ids[1]."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.seeds: list[int | None] = []

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        self.calls.append([r.request_id for r in requests])
        self.seeds += [r.seed for r in requests]
        out = []
        for r in requests:
            num_correct, truncated = r.prompt_ids[0], r.prompt_ids[1]
            for i in range(r.n):
                response = [1 if i < num_correct else 0] + [7] * (i + 1)
                out.append(
                    Sample(
                        r.request_id,
                        i,
                        r.prompt_ids,
                        response,
                        [-0.5] * len(response),
                        "length" if truncated else "stop",
                    )
                )
        return out[::-1]  # any order: the manager regroups


class DigitTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(ids[0])


def reward(response: str, label: str) -> float:
    return 1.0 if response == label else 0.0


def _cfg(**kw: object) -> RolloutConfig:
    base = dict(
        prompts_per_step=2,
        n_samples_per_prompt=4,
        over_sampling_prompts=3,
        max_sampling_rounds=3,
        max_response_len=8,
    )
    return RolloutConfig(**{**base, **kw})  # type: ignore[arg-type]


def _manager(engines: list[ScriptedEngine], cfg: RolloutConfig) -> RolloutManager:
    return RolloutManager(engines, cfg, reward, DigitTokenizer(), stop_token_ids=[2], seed=0)


def _prompt(num_correct: int, truncated: int = 0) -> Prompt:
    return Prompt([num_correct, truncated, 9], "1")


def test_dynamic_sampling_keeps_groups_with_spread_and_counts_everything() -> None:
    # Round 1 draws [0, 4, 2] correct: one kept, two dropped. Round 2 draws [4, 1, 3]: one dropped, two kept,
    # of which one is surplus.
    prompts = [
        _prompt(0),
        _prompt(4),
        _prompt(2),
        _prompt(4, truncated=1),
        _prompt(1, truncated=1),
        _prompt(3),
    ]
    batch = _manager([ScriptedEngine()], _cfg()).generate(PromptSource(prompts, seed=0, shuffle=False))
    assert batch.num_groups == 2 and batch.group_size == 4 and batch.num_samples == 8
    assert batch.rewards == [1, 1, 0, 0] + [1, 0, 0, 0]  # prompts with 2 and 1 correct, in draw order
    assert [s.index for s in batch.samples] == [0, 1, 2, 3] * 2
    assert len({s.request_id for s in batch.samples[:4]}) == 1
    m = batch.metrics
    assert (
        m[names.ROLLOUT_ROUNDS] == 2
        and m[names.ROLLOUT_KEPT_GROUPS] == 2
        and m[names.ROLLOUT_DROPPED_GROUPS] == 3
    )
    assert (
        m[names.ROLLOUT_SURPLUS_GROUPS] == 1
        and m[names.ROLLOUT_FILLED_GROUPS] == 0
        and batch.num_filled_groups == 0
    )
    assert m["rollout/response_len_mean"] == 3.5 and m[names.ROLLOUT_RESPONSE_LEN_MAX] == 5
    assert m["rollout/truncated_frac"] == 0.5 and m[names.ROLLOUT_ABORTED_FRAC] == 0
    assert m["rollout/reward_mean"] == 3 / 8
    assert m[names.ROLLOUT_REWARD_MEAN_ALL] == (0 + 4 + 2 + 4 + 1 + 3) / 24


def test_shortfall_is_filled_with_dropped_groups_and_reported() -> None:
    prompts = [_prompt(0), _prompt(4), _prompt(2)]
    batch = _manager([ScriptedEngine()], _cfg(max_sampling_rounds=1)).generate(
        PromptSource(prompts, seed=0, shuffle=False)
    )
    # One group with spread (2 correct); the first dropped group (0 correct) fills the second slot.
    assert batch.num_groups == 2 and batch.num_filled_groups == 1
    assert batch.rewards == [1.0, 1.0, 0.0, 0.0] + [0.0] * 4
    assert batch.metrics[names.ROLLOUT_FILLED_GROUPS] == 1 and batch.metrics[names.ROLLOUT_KEPT_GROUPS] == 1


def test_a_group_whose_rewards_differ_below_float32_resolution_has_no_spread() -> None:
    # A shaped reward (1 - 1e-8 * length) separates the answers in float64 but not in the float32 tensor the
    # advantages come from: such a group was kept as one "with spread" and trained with advantages all 0.
    from infir2_rl.algo.advantages import grpo_advantages

    def shaped(response: str, label: str) -> float:
        return 1.0 - 1e-8 * int(response == label)

    cfg = _cfg(prompts_per_step=1, over_sampling_prompts=1, max_sampling_rounds=1)
    manager = RolloutManager([ScriptedEngine()], cfg, shaped, DigitTokenizer(), stop_token_ids=[2], seed=0)
    batch = manager.generate(PromptSource([_prompt(2)], seed=0, shuffle=False))
    assert batch.num_filled_groups == 1 and batch.metrics[names.ROLLOUT_KEPT_GROUPS] == 0
    assert not grpo_advantages(batch.rewards_tensor(), batch.group_size).any()


def test_without_dynamic_sampling_exactly_prompts_per_step_are_drawn() -> None:
    source = PromptSource([_prompt(0), _prompt(4), _prompt(2)], seed=0, shuffle=False)
    batch = _manager([ScriptedEngine()], _cfg(dynamic_sampling=False)).generate(source)
    assert batch.rewards == [0.0] * 4 + [1.0] * 4 and batch.metrics[names.ROLLOUT_ROUNDS] == 1
    assert source.cursor == 2


def test_requests_are_spread_over_engines_and_seeded_by_a_saved_counter() -> None:
    engines = [ScriptedEngine(), ScriptedEngine()]
    cfg = _cfg(dynamic_sampling=False, prompts_per_step=3)
    manager = RolloutManager(engines, cfg, reward, DigitTokenizer(), stop_token_ids=[2], seed=5)
    manager.generate(PromptSource([_prompt(1), _prompt(2), _prompt(3)], seed=0, shuffle=False))
    assert engines[0].calls == [["req0", "req2"]] and engines[1].calls == [["req1"]]
    # Every request's seed comes from the stage's seed and the request counter (5 * 1,000,003 + n).
    assert engines[0].seeds == [5_000_015, 5_000_017] and engines[1].seeds == [5_000_016]
    assert manager.state_dict() == {"num_requests": 3}
    engine = ScriptedEngine()
    one = _cfg(dynamic_sampling=False, prompts_per_step=1)
    restored = RolloutManager([engine], one, reward, DigitTokenizer(), stop_token_ids=[2], seed=5)
    restored.load_state_dict(manager.state_dict())
    restored.generate(PromptSource([_prompt(1)], seed=0, shuffle=False))
    assert engine.calls == [["req3"]] and engine.seeds == [5_000_018]  # a resumed run goes on counting


def test_evaluate_scores_one_greedy_answer_per_prompt_and_leaves_the_training_seeds_alone() -> None:
    engine = ScriptedEngine()
    manager = _manager([engine], _cfg())
    result = manager.evaluate([_prompt(1), _prompt(0, truncated=1)])
    assert result.accuracy == 0.5 and result.num_prompts == 2
    assert result.response_len_mean == 2 and result.truncated_frac == 0.5
    # Evaluation used to draw from the training requests' counter, so when and how much a stage evaluated
    # changed every later rollout's seeds (a resumed run with another eval_every trained differently).
    assert engine.calls == [["eval0", "eval1"]] and manager.state_dict() == {"num_requests": 0}


def test_token_batches_align_response_tokens_logprobs_and_advantages() -> None:
    samples = [
        Sample("a", 0, [10, 11], [20, 21, 22], [-0.1, -0.2, -0.3], "stop"),
        Sample("a", 1, [10, 11], [23], [-0.4], "length"),
        Sample("b", 0, [12, 13, 14], [24, 25], [-0.5, -0.6], "stop"),
        Sample("b", 1, [12, 13, 14], [26], [-0.7], "stop"),
    ]
    batch = RolloutBatch(samples, [1.0, 0.0, 0.0, 1.0], group_size=2, labels=["x", "y"])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    micro = to_token_batches(batch, adv, pad_id=0, micro_batch_size=3)
    assert [m.num_sequences for m in micro] == [3, 1]
    first = micro[0]
    assert first.input_ids.tolist() == [[10, 11, 20, 21, 22], [10, 11, 23, 0, 0], [12, 13, 14, 24, 25]]
    assert first.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert first.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 0, 1, 1]]
    torch.testing.assert_close(
        first.rollout_logprobs,
        torch.tensor([[0, 0, -0.1, -0.2, -0.3], [0, 0, -0.4, 0, 0], [0, 0, 0, -0.5, -0.6]]),
    )
    assert first.advantages is not None and first.advantages.tolist() == [1.0, -1.0, -1.0]
    assert micro[1].input_ids.tolist() == [[12, 13, 14, 26]] and micro[1].num_targets == 1
    with pytest.raises(ValueError, match="one each"):
        to_token_batches(batch, adv[:3], pad_id=0, micro_batch_size=2)


def test_prompt_source_is_seeded_crosses_epochs_and_resumes() -> None:
    prompts = [_prompt(i) for i in range(5)]
    a = PromptSource(prompts, seed=3)
    first = [p.prompt_ids[0] for p in a.take(7)]
    assert sorted(first[:5]) == [0, 1, 2, 3, 4] and a.epoch == 1 and a.cursor == 2
    assert first == [p.prompt_ids[0] for p in PromptSource(prompts, seed=3).take(7)]
    assert first[:5] != [p.prompt_ids[0] for p in PromptSource(prompts, seed=4).take(5)]
    state = a.state_dict()
    b = PromptSource(prompts, seed=3)
    b.load_state_dict(state)
    assert [p.prompt_ids[0] for p in b.take(6)] == [p.prompt_ids[0] for p in a.take(6)]
    with pytest.raises(ValueError, match="same data"):
        PromptSource(prompts[:4], seed=3).load_state_dict(state)


def test_a_rewards_timeouts_and_errors_of_a_step_are_published(monkeypatch: pytest.MonkeyPatch) -> None:
    """reward/timeouts and reward/errors: what a counting reward's counters (``stats_snapshot``, as a
    ``MathReward`` keeps them) gained during the step; absent for a reward that keeps none."""
    from infir2_rl.reward.math import RewardStats
    from infir2_rl.rollout import manager as manager_module

    class CountingReward:
        def __init__(self) -> None:
            self.readings = iter(
                [RewardStats(num_timeouts=5, num_errors=1), RewardStats(num_timeouts=7, num_errors=1)]
            )

        def __call__(self, response: str, label: str) -> float:
            return 0.0

        def stats_snapshot(self) -> RewardStats:
            return next(self.readings)

    monkeypatch.setattr(manager_module, "score_batch", lambda fn, texts, labels: [0.0] * len(texts))
    cfg = _cfg(dynamic_sampling=False)
    counting = RolloutManager(
        [ScriptedEngine()], cfg, CountingReward(), DigitTokenizer(), stop_token_ids=[2], seed=0
    )
    batch = counting.generate(PromptSource([_prompt(1)], seed=0, shuffle=False))
    assert batch.metrics[names.REWARD_TIMEOUTS] == 2.0 and batch.metrics[names.REWARD_ERRORS] == 0.0
    other = _manager([ScriptedEngine()], cfg).generate(PromptSource([_prompt(1)], seed=0, shuffle=False))
    assert names.REWARD_TIMEOUTS not in other.metrics


def test_the_built_in_math_reward_and_a_math_reward_object_report_their_counters() -> None:
    """``counters``: the built-in function reads its process-wide ``MathReward``; a ``MathReward`` made by a
    factory (``rollout.reward: my_pkg:make_reward``) reads its own; a plain function has none."""
    from infir2_rl.reward.math import MathReward, math_reward, reward_stats
    from infir2_rl.reward.protocol import batch_scorer, counters

    assert counters(math_reward) is reward_stats
    own = MathReward(num_workers=1)
    snapshot = counters(own)
    assert snapshot is not None and snapshot() == own.stats and snapshot() is not own.stats  # a copy
    assert own("</think> \\boxed{3}", "3") == 1.0 and snapshot().num_calls == 1
    assert batch_scorer(own) == own.score_many and batch_scorer(math_reward) is not None
    assert counters(lambda r, lab: 0.0) is None and batch_scorer(lambda r, lab: 0.0) is None
    own.close()
