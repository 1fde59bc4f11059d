"""The rollout manager: prompts -> GRPO groups from the engines -> rewards -> dynamic sampling -> RolloutBatch.

One ``generate`` call builds the batch of one RL step, ``prompts_per_step`` groups of
``n_samples_per_prompt`` samples:

1. A round draws prompts from the ``PromptSource`` (``over_sampling_prompts`` with dynamic sampling,
   else exactly ``prompts_per_step``), makes one ``GenerateRequest`` per prompt (n samples, the stage's
   temperature, ``max_new_tokens = max_response_len``, the stop tokens, a seed from the manager's seed
   and a request counter) and spreads them round-robin over the engines: one call per engine, one
   ``ray.get`` for the round.
2. Every response is decoded (special tokens skipped; ``<think>``/``</think>`` are kept) and scored with
   the reward function against its prompt's label.
3. Dynamic sampling (DAPO): a group whose rewards are all equal has zero GRPO advantage, so it is
   dropped; rounds repeat until ``prompts_per_step`` groups are kept or ``max_sampling_rounds`` ran.
   Kept groups beyond the need are discarded (counted as surplus).
4. Shortfall policy: the RL loop trains on a fixed global batch (``prompts_per_step x n``), so when the
   rounds run out the batch is filled with dropped groups, in the order they were drawn, and counted
   (``rollout/filled_groups``). All dropped groups have zero spread, hence zero advantage: they add
   no gradient, only tokens to the loss normaliser, i.e. the gradient is scaled down by the fill fraction,
   as it would be without dynamic sampling. (The update is not scaled the same way: Adam divides by the
   gradient's running magnitude, and with every group filled it still moves the weights by its momentum and
   weight decay.)

Metrics (``RolloutBatch.metrics``): lengths, truncation, rewards and aborted fraction of the batch,
reward mean over everything generated (unbiased by the filter), kept/dropped/filled/surplus groups,
rounds, generated tokens per second and the time spent generating and scoring.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from infir2_rl.actors.remote import Call, call_all
from infir2_rl.config.components import RolloutConfig
from infir2_rl.metrics import names
from infir2_rl.reward.protocol import RewardFn, counters, score_batch
from infir2_rl.rollout.batch import RolloutBatch
from infir2_rl.rollout.prompts import PromptLike, PromptSource
from infir2_rl.types import GenerateRequest, Sample, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Group:
    """The n scored samples of one prompt."""

    prompt: PromptLike
    samples: list[Sample]
    rewards: list[float]

    @property
    def has_spread(self) -> bool:
        # Judged on the float32 rewards the advantages are computed from (RolloutBatch.rewards_tensor): rewards
        # that differ by less than a float32 step would pass here and still get advantage 0 there.
        r = torch.tensor(self.rewards, dtype=torch.float32)
        return bool(r.max() != r.min())


@dataclass
class EvalResult:
    """Greedy held-out evaluation: mean reward (accuracy for 0/1 rewards) and response statistics."""

    accuracy: float
    num_prompts: int
    response_len_mean: float
    truncated_frac: float


class RolloutManager:
    """Builds RL batches from engines (Ray actor handles or local ``EngineBackend`` objects)."""

    def __init__(
        self,
        engines: Sequence[Any],
        cfg: RolloutConfig,
        reward_fn: RewardFn,
        tokenizer: PreTrainedTokenizerBase,
        stop_token_ids: Sequence[int],
        seed: int,
        timeout_s: float | None = None,
    ) -> None:
        if not engines:
            raise ValueError("RolloutManager needs at least one engine (rollout.num_engines >= 1)")
        self.engines = list(engines)
        self.cfg = cfg
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.seed = seed
        self.timeout_s = timeout_s
        self.num_requests = 0  # requests issued so far; part of every request's seed (saved in checkpoints)

    def state_dict(self) -> dict[str, int]:
        return {"num_requests": self.num_requests}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_requests = int(state["num_requests"])

    # ---- sampling -------------------------------------------------------------------------------
    def sample_groups(self, prompts: Sequence[PromptLike], n: int, params: SamplingParams) -> list[Group]:
        """n samples of each prompt from the engines, decoded and scored, in prompt order."""
        groups = self._sample(prompts, n, params)
        self._score(groups)
        return groups

    def _sample(
        self, prompts: Sequence[PromptLike], n: int, params: SamplingParams, *, held_out: bool = False
    ) -> list[Group]:
        """``held_out`` (greedy evaluation) requests are named apart and leave ``num_requests`` alone: they need
        no seed, and counting them made every later training rollout's seeds depend on when and on how many
        problems the stage evaluated (so a resumed run with another eval_every, or an extended one, which
        evaluates at its old last step, trained differently from a straight run)."""
        requests = []
        for i, prompt in enumerate(prompts):
            number = i if held_out else self.num_requests
            requests.append(
                GenerateRequest(
                    request_id=f"eval{number}" if held_out else f"req{number}",
                    prompt_ids=list(prompt.prompt_ids),
                    n=n,
                    params=params,
                    seed=self.seed * 1_000_003 + number,
                )
            )
            if not held_out:
                self.num_requests += 1
        num_engines = len(self.engines)
        calls = [Call(e, "generate", (requests[i::num_engines],)) for i, e in enumerate(self.engines)]
        by_request: dict[str, list[Sample]] = {}
        for samples in call_all([c for c in calls if c.args[0]], self.timeout_s):
            for s in samples:
                by_request.setdefault(s.request_id, []).append(s)
        groups = []
        for prompt, req in zip(prompts, requests):
            samples = sorted(by_request.get(req.request_id, []), key=lambda s: s.index)
            if len(samples) != n:
                raise RuntimeError(
                    f"engine returned {len(samples)} samples for {req.request_id}, expected {n}"
                )
            groups.append(Group(prompt=prompt, samples=samples, rewards=[]))
        return groups

    def _score(self, groups: list[Group]) -> None:
        texts = [
            str(self.tokenizer.decode(s.response_ids, skip_special_tokens=True))
            for g in groups
            for s in g.samples
        ]
        labels = [g.prompt.label for g in groups for _ in g.samples]
        rewards = iter(score_batch(self.reward_fn, texts, labels))
        for g in groups:
            g.rewards = [next(rewards) for _ in g.samples]

    def _params(self, greedy: bool = False) -> SamplingParams:
        return SamplingParams(
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            top_k=self.cfg.top_k,
            max_new_tokens=self.cfg.max_response_len,
            stop_token_ids=list(self.stop_token_ids),
            greedy=greedy,
        )

    def generate(self, source: PromptSource) -> RolloutBatch:
        """The scored batch of one RL step (see the module docstring)."""
        cfg = self.cfg
        need, n = cfg.prompts_per_step, cfg.n_samples_per_prompt
        per_round = cfg.over_sampling_prompts if cfg.dynamic_sampling else need
        max_rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
        kept: list[Group] = []
        dropped: list[Group] = []
        everything: list[Group] = []
        rounds, gen_time, score_time = 0, 0.0, 0.0
        params = self._params()
        # A reward that counts how it scored (reward.protocol.counters: the built-in math reward, a MathReward,
        # any object with stats_snapshot()): the step's share of its timeouts and errors is published.
        snapshot = counters(self.reward_fn)
        stats_before = snapshot() if snapshot is not None else None
        while len(kept) < need and rounds < max_rounds:
            t0 = time.perf_counter()
            groups = self._sample(source.take(per_round), n, params)
            t1 = time.perf_counter()
            self._score(groups)
            gen_time, score_time = gen_time + t1 - t0, score_time + time.perf_counter() - t1
            rounds += 1
            everything += groups
            for g in groups:
                (kept if g.has_spread or not cfg.dynamic_sampling else dropped).append(g)
        surplus = max(0, len(kept) - need)
        filled = dropped[: max(0, need - len(kept))]
        final = kept[:need] + filled
        if len(final) < need:
            raise RuntimeError(f"only {len(final)} groups were generated for prompts_per_step={need}")
        batch = self._batch(
            final, everything, len(dropped), len(filled), surplus, rounds, gen_time, score_time
        )
        if snapshot is not None and stats_before is not None:
            after = snapshot()
            batch.metrics[names.REWARD_TIMEOUTS] = float(after.num_timeouts - stats_before.num_timeouts)
            batch.metrics[names.REWARD_ERRORS] = float(after.num_errors - stats_before.num_errors)
        return batch

    def _batch(
        self,
        groups: list[Group],
        everything: list[Group],
        num_dropped: int,
        num_filled: int,
        num_surplus: int,
        rounds: int,
        gen_time: float,
        score_time: float,
    ) -> RolloutBatch:
        samples = [s for g in groups for s in g.samples]
        rewards = [r for g in groups for r in g.rewards]
        lengths = [len(s.response_ids) for s in samples]
        generated = sum(len(s.response_ids) for g in everything for s in g.samples)
        all_rewards = [r for g in everything for r in g.rewards]
        metrics = {
            names.ROLLOUT_RESPONSE_LEN_MEAN: statistics.fmean(lengths),
            names.ROLLOUT_RESPONSE_LEN_MAX: float(max(lengths)),
            names.ROLLOUT_TRUNCATED_FRAC: sum(s.finish_reason == "length" for s in samples) / len(samples),
            names.ROLLOUT_ABORTED_FRAC: sum(s.finish_reason == "abort" for s in samples) / len(samples),
            names.ROLLOUT_REWARD_MEAN: statistics.fmean(rewards),
            names.ROLLOUT_REWARD_STD: statistics.pstdev(rewards),
            names.ROLLOUT_REWARD_MEAN_ALL: statistics.fmean(all_rewards),
            names.ROLLOUT_KEPT_GROUPS: float(len(groups) - num_filled),
            names.ROLLOUT_DROPPED_GROUPS: float(num_dropped),
            names.ROLLOUT_FILLED_GROUPS: float(num_filled),
            names.ROLLOUT_SURPLUS_GROUPS: float(num_surplus),
            names.ROLLOUT_ROUNDS: float(rounds),
            names.ROLLOUT_TOKENS_PER_S: generated / gen_time if gen_time > 0 else 0.0,
            names.ROLLOUT_GEN_TIME_S: gen_time,
            names.ROLLOUT_SCORE_TIME_S: score_time,
        }
        return RolloutBatch(
            samples=samples,
            rewards=rewards,
            group_size=self.cfg.n_samples_per_prompt,
            labels=[g.prompt.label for g in groups],
            num_filled_groups=num_filled,
            metrics=metrics,
        )

    def evaluate(self, prompts: Sequence[PromptLike]) -> EvalResult:
        """Greedy answers (one per prompt, up to max_response_len tokens) scored with the reward function."""
        if not prompts:
            raise ValueError("evaluate() got no prompts: check data.test_path and data.num_eval_examples")
        log.info("evaluating: greedy answers to %d held-out problems", len(prompts))
        groups = self._sample(prompts, 1, self._params(greedy=True), held_out=True)
        self._score(groups)
        samples = [g.samples[0] for g in groups]
        return EvalResult(
            accuracy=statistics.fmean(g.rewards[0] for g in groups),
            num_prompts=len(groups),
            response_len_mean=statistics.fmean(len(s.response_ids) for s in samples),
            truncated_frac=sum(s.finish_reason == "length" for s in samples) / len(samples),
        )

    def abort(self) -> None:
        """Stop every engine's running generate (they return what they have, finish "abort")."""
        call_all([Call(e, "abort") for e in self.engines], self.timeout_s)
