"""Before a colocated rollout the RL stage asks the engines what their KV cache wants and has the trainer make
room (``RlActors.make_room_for_rollout``): only colocated on GPUs, with the largest engine's ask, and the step's
metric says whether a rank dropped its layer graphs. Local fakes stand in for the Ray actors."""

from __future__ import annotations

from typing import Any

from infir2_rl.metrics import names
from infir2_rl.stages.rl_setup import RlActors


class FakeEngine:
    def __init__(self, wanted: int | None) -> None:
        self.wanted = wanted

    def memory_wanted(self) -> int | None:
        return self.wanted


class FakeTrainer:
    def __init__(self, dropped: list[bool]) -> None:
        self.dropped = dropped
        self.asked: list[int] = []

    def make_room(self, wanted_bytes: int) -> list[bool]:
        self.asked.append(wanted_bytes)
        return self.dropped


def _actors(trainer: FakeTrainer, engines: list[FakeEngine], colocated: bool) -> RlActors:
    none: Any = None
    return RlActors(trainer, engines, none, none, none, none, pad_id=0, colocated_gpu=colocated)  # type: ignore[arg-type]


def test_the_trainer_makes_room_for_the_largest_engine_ask_only_when_colocated() -> None:
    trainer = FakeTrainer([False, True])
    engines = [FakeEngine(100), FakeEngine(300), FakeEngine(None)]
    assert _actors(trainer, engines, colocated=False).make_room_for_rollout() == {}
    assert trainer.asked == []  # apart: the engines have GPUs of their own
    got = _actors(trainer, engines, colocated=True).make_room_for_rollout()
    assert trainer.asked == [300] and got == {names.MEMORY_TRAINER_GRAPHS_DROPPED: 1.0}
    kept = FakeTrainer([False, False])
    assert _actors(kept, engines, colocated=True).make_room_for_rollout() == {
        names.MEMORY_TRAINER_GRAPHS_DROPPED: 0.0
    }


def test_nothing_is_asked_before_the_first_rollout_or_of_engines_that_do_not_say() -> None:
    trainer = FakeTrainer([True])
    assert _actors(trainer, [FakeEngine(None)], colocated=True).make_room_for_rollout() == {}
    assert trainer.asked == []
