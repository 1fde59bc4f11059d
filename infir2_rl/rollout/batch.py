"""The rollout batch handed from the rollout manager to the RL loop, and its conversion to trainer micro-batches.

Layout: groups are contiguous. ``samples[g * group_size + i]`` is sample i of prompt g, ``rewards`` and
advantages follow the same order (the layout ``algo.advantages.grpo_advantages`` expects).

Token alignment (``infir2_rl.types.TokenBatch``): the value at position t belongs to token t. A sequence
is ``prompt + response`` right-padded; ``loss_mask[t] = 1`` exactly on response tokens, and
``rollout_logprobs[t]`` holds the engine's log-prob of response token t (0 elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from infir2_rl.types import Sample, TokenBatch


@dataclass
class RolloutBatch:
    """``num_groups x group_size`` scored samples, groups contiguous, plus what the step logs about them."""

    samples: list[Sample]
    # One reward per sample, same order.
    rewards: list[float]
    group_size: int
    # One reference answer per group.
    labels: list[str]
    # Groups without reward spread put in to reach prompts_per_step (zero advantage, no gradient).
    num_filled_groups: int = 0
    # Metric name -> value ("rollout/..."), see rollout.manager.
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert len(self.samples) == len(self.rewards) == len(self.labels) * self.group_size

    @property
    def num_groups(self) -> int:
        return len(self.labels)

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def rewards_tensor(self) -> Tensor:
        return torch.tensor(self.rewards, dtype=torch.float32)


def to_token_batches(
    batch: RolloutBatch, advantages: Tensor, pad_id: int, micro_batch_size: int
) -> list[TokenBatch]:
    """Micro-batches of ``micro_batch_size`` sequences in batch order, each right-padded to its own longest.

    ``advantages``: one per sample (``grpo_advantages(batch.rewards_tensor(), batch.group_size)``).
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}: must be >= 1")
    if advantages.numel() != batch.num_samples:
        raise ValueError(
            f"advantages has {advantages.numel()} values for {batch.num_samples} samples: pass one each"
        )
    advantages = advantages.detach().float().reshape(-1).cpu()
    out = []
    for start in range(0, batch.num_samples, micro_batch_size):
        chunk = batch.samples[start : start + micro_batch_size]
        length = max(len(s.prompt_ids) + len(s.response_ids) for s in chunk)
        input_ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), length), dtype=torch.long)
        loss_mask = torch.zeros((len(chunk), length), dtype=torch.float32)
        rollout_logprobs = torch.zeros((len(chunk), length), dtype=torch.float32)
        for b, s in enumerate(chunk):
            p, r = len(s.prompt_ids), len(s.response_ids)
            if len(s.logprobs) != r:
                raise ValueError(
                    f"sample {s.request_id}/{s.index}: {len(s.logprobs)} log-probs for {r} response tokens"
                )
            input_ids[b, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
            attention_mask[b, : p + r] = 1
            loss_mask[b, p : p + r] = 1.0
            rollout_logprobs[b, p : p + r] = torch.tensor(s.logprobs, dtype=torch.float32)
        out.append(
            TokenBatch(
                input_ids=input_ids,
                attention_mask=attention_mask,
                loss_mask=loss_mask,
                rollout_logprobs=rollout_logprobs,
                advantages=advantages[start : start + len(chunk)].clone(),
            )
        )
    return out
