"""Before a colocated rollout the RL stage asks the engines what their KV cache wants and has the trainer make
room (``RlActors.make_room_for_rollout``): only colocated on GPUs, with the largest engine's ask, and the step's
metric says whether a rank dropped its layer graphs. After a rollout, ``rollout/kv_slots_short`` says whether an
engine's rows took turns for memory. Local fakes stand in for the Ray actors."""

from __future__ import annotations

from typing import Any

from infir2_rl.metrics import names
from infir2_rl.stages.rl_setup import RlActors


class FakeEngine:
    def __init__(self, wanted: int | None, short: int | None = None) -> None:
        self.wanted, self.short = wanted, short

    def memory_wanted(self) -> int | None:
        return self.wanted

    def kv_slots_short(self) -> int | None:
        return self.short


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


def test_the_step_reports_the_largest_kv_slot_shortfall_of_the_engines_that_say() -> None:
    engines = [FakeEngine(None, short=0), FakeEngine(None, short=32), FakeEngine(None)]
    got = _actors(FakeTrainer([]), engines, colocated=True).kv_slots_short()
    assert got == {names.ROLLOUT_KV_SLOTS_SHORT: 32.0}
    assert _actors(FakeTrainer([]), [FakeEngine(None)], colocated=False).kv_slots_short() == {}
