"""A resumable stream of RL prompts: seeded shuffle per epoch, with a cursor saved in checkpoints.

Epoch e visits every prompt once in the order ``random.Random(seed * 1_000_003 + e).shuffle(range(N))``
(or file order when ``shuffle=False``); ``take(k)`` continues across epoch boundaries. The state is
(epoch, cursor, N), so a resumed run draws exactly the prompts the stopped run would have drawn next.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


class PromptLike(Protocol):
    """What the rollout manager needs of a prompt (``data.datasets.PromptExample`` fits)."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def label(self) -> str: ...


class PromptSource:
    """Endless, reproducible iteration over a fixed list of prompts."""

    def __init__(self, examples: Sequence[PromptLike], seed: int, shuffle: bool = True) -> None:
        if not examples:
            raise ValueError("PromptSource got no prompts: check data.train_path and the skipped-row report")
        self.examples = list(examples)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[PromptLike]:
        """The next ``k`` prompts (crossing into the next epoch when this one runs out)."""
        out = []
        for _ in range(k):
            if self.cursor == len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._order_of(self.epoch)
            out.append(self.examples[self._order[self.cursor]])
            self.cursor += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_examples"] != len(self.examples):
            raise ValueError(
                f"prompt state was saved with {state['num_examples']} prompts but {len(self.examples)} are loaded:"
                " resume with the same data.train_path and data.max_prompt_tokens"
            )
        if not 0 <= state["cursor"] <= len(self.examples):
            raise ValueError(f"prompt state cursor={state['cursor']} is outside [0, {len(self.examples)}]")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._order_of(self.epoch)
