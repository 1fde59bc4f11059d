"""Held-out evaluation of the SFT stage: per-token loss and answer accuracy of greedy generations.

Accuracy: each held-out conversation's last assistant message holds the reference solution; its final
`\\boxed{}` answer (after `</think>`) is the label. The prompt is the conversation before that message,
rendered with the chat template's generation prompt; the trainer greedily completes it (HF generate on
the trainer ranks, batched) and `math_reward` (parallel, `math_reward_many`) scores the completion against the label. Rows whose
reference has no boxed final answer count for the loss only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from infir2_rl.algo.sft_loss import sft_loss
from infir2_rl.config import SftDataConfig
from infir2_rl.data.batching import collate_sft
from infir2_rl.data.datasets import SftExample, load_sft_examples
from infir2_rl.data.readers import read_records
from infir2_rl.metrics import names
from infir2_rl.reward import extract_final_answer
from infir2_rl.reward.math import math_reward_many
from infir2_rl.types import LossOutput, TokenBatch, TokenScores

log = logging.getLogger(__name__)

# Room for a completion a little longer than the longest reference answer.
EXTRA_NEW_TOKENS = 16


class SftLossFn:
    """Mean next-token cross-entropy over assistant tokens; units = target tokens (picklable)."""

    temperature = 1.0
    needs_entropy = False

    def __call__(self, scores: TokenScores, batch: TokenBatch) -> LossOutput:
        known = batch.counts.num_targets if batch.counts is not None else None
        loss, num_tokens = sft_loss(scores.logprobs_BL, batch.loss_mask, num_tokens=known)
        return LossOutput(loss=loss, num_units=num_tokens)


def num_target_tokens(batch: TokenBatch) -> int:
    """Loss units of SftLossFn over a batch: masked tokens after position 0."""
    return batch.num_targets


def to_token_batch(examples: Sequence[SftExample], pad_token_id: int) -> TokenBatch:
    b = collate_sft(examples, pad_token_id)
    return TokenBatch(input_ids=b.input_ids, attention_mask=b.attention_mask, loss_mask=b.loss_mask)


@dataclass
class SftEvalSet:
    """The held-out examples of one stage, tokenized once."""

    loss_batch: TokenBatch
    prompts: list[list[int]]
    labels: list[str]
    max_new_tokens: int


class Evaluates(Protocol):
    def evaluate_loss(self, batch: TokenBatch, loss_fn: SftLossFn) -> float: ...

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]: ...


def load_eval_set(data: SftDataConfig, tokenizer: Any) -> SftEvalSet | None:
    """Tokenize the first `data.num_eval_examples` held-out rows (None when there is no test file)."""
    if data.test_path is None:
        return None
    limit = data.num_eval_examples
    examples, _ = load_sft_examples(
        data.test_path,
        tokenizer,
        messages_key=data.messages_key,
        max_seq_len=data.max_seq_len,
        format=data.format,
    )
    examples = examples[:limit]
    prompts: list[list[int]] = []
    labels: list[str] = []
    answer_lens: list[int] = []
    skipped = {"no final assistant message": 0, "no boxed answer": 0, "prompt too long": 0}
    for row in read_records(data.test_path, data.format):
        if limit is not None and len(prompts) >= limit:
            break
        messages = (row.data or {}).get(data.messages_key)
        if not (isinstance(messages, list) and messages and isinstance(messages[-1], dict)):
            skipped["no final assistant message"] += 1
            continue
        if messages[-1].get("role") != "assistant" or not isinstance(messages[-1].get("content"), str):
            skipped["no final assistant message"] += 1
            continue
        label = extract_final_answer(messages[-1]["content"])
        if label is None:
            skipped["no boxed answer"] += 1
            continue
        text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(prompt_ids) >= data.max_seq_len:
            skipped["prompt too long"] += 1
            continue
        prompts.append(list(prompt_ids))
        labels.append(label)
        answer_lens.append(len(tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]) + 1)
    if not prompts:
        log.warning(
            "%s: no held-out row has a boxed final answer: eval/accuracy is not measured", data.test_path
        )
    elif any(skipped.values()):
        log.info(
            "%s: eval/accuracy over %d held-out problems; rows left out: %s", data.test_path, len(prompts),
            ", ".join(f"{n} {why}" for why, n in skipped.items() if n),
        )  # fmt: skip
    max_new = min(max(answer_lens, default=1) + EXTRA_NEW_TOKENS, data.max_seq_len)
    return SftEvalSet(to_token_batch(examples, tokenizer.pad_token_id), prompts, labels, max_new)


def evaluate(trainer: Evaluates, eval_set: SftEvalSet, tokenizer: Any) -> dict[str, float]:
    """eval/loss (per target token) and, when prompts have labels, eval/accuracy."""
    start = time.perf_counter()
    # A line before the work: on a 2-core CPU greedy answers to 500 problems take a minute or more, without output.
    log.info(
        "evaluating: loss on %d held-out rows, greedy answers to %d problems",
        eval_set.loss_batch.num_sequences,
        len(eval_set.prompts),
    )
    metrics = {names.EVAL_LOSS: trainer.evaluate_loss(eval_set.loss_batch, SftLossFn())}
    if eval_set.prompts:
        completions = trainer.generate_greedy(eval_set.prompts, eval_set.max_new_tokens)
        texts = tokenizer.batch_decode(completions, skip_special_tokens=False)
        correct = sum(math_reward_many(texts, eval_set.labels))  # in parallel worker processes
        metrics[names.EVAL_ACCURACY] = correct / len(eval_set.labels)
    log.info("evaluated in %.1f s", time.perf_counter() - start)
    return metrics
