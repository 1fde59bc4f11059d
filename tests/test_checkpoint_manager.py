"""CheckpointManager: complete-or-ignored directories, the `latest` pointer, keep-last-K, failed saves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from infir2_rl.checkpoint import CheckpointManager, DataCursor, StageState, save_checkpoint
from infir2_rl.stages.common import epoch_order, next_batch, resume_state


class FakeTrainer:
    """Writes what a trainer group writes (hf/ and one train-state file), or fails half-way."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def save(self, directory: Path) -> None:
        (directory / "hf").mkdir()
        save_file({"w": torch.arange(6.0)}, str(directory / "hf" / "model.safetensors"))
        if self.fail:
            raise RuntimeError("killed mid-save")
        (directory / "train_state").mkdir()
        torch.save({"step": 1}, directory / "train_state" / "rank_0.pt")


def state(step: int) -> StageState:
    return StageState(
        step=step, cursor=DataCursor(epoch=1, position=8 * step), skipped_steps=1, num_examples=40
    )


def test_save_is_complete_pointed_to_and_round_trips(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.latest() is None
    ckpt = save_checkpoint(FakeTrainer(), manager, state(3))
    assert ckpt.path == tmp_path / "step_000003" and (ckpt.path / "DONE").is_file()
    assert (tmp_path / "latest").read_text().strip() == "step_000003"
    assert manager.latest() == ckpt and ckpt.read_state() == state(3)
    assert (ckpt.hf_dir / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".tmp_*"))


def test_keep_last_deletes_only_older_complete_checkpoints(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        save_checkpoint(FakeTrainer(), manager, state(step))
    assert [c.step for c in manager.complete()] == [3, 4]
    assert manager.latest() is not None and manager.latest().step == 4  # type: ignore[union-attr]


def test_a_save_killed_midway_leaves_the_previous_checkpoint_in_charge(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1)
    good = save_checkpoint(FakeTrainer(), manager, state(2))
    with pytest.raises(RuntimeError, match="killed mid-save"):
        save_checkpoint(FakeTrainer(fail=True), manager, state(4))
    assert not (tmp_path / ".tmp_step_000004").exists()  # a failed save removes its temp directory
    (tmp_path / ".tmp_step_000004" / "hf").mkdir(parents=True)  # what a SIGKILL mid-save leaves
    # A directory with a final name but no DONE (e.g. copied by hand, or another tool) is not trusted either.
    (tmp_path / "step_000009" / "hf").mkdir(parents=True)
    assert manager.latest() == good and [c.step for c in manager.complete()] == [2]
    assert (good.path / "train_state" / "rank_0.pt").is_file()
    # The next save clears the leftover temp directory.
    save_checkpoint(FakeTrainer(), manager, state(5))
    assert not (tmp_path / ".tmp_step_000004").exists()
    assert manager.latest().step == 5  # type: ignore[union-attr]


def test_latest_survives_a_stale_or_missing_pointer(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    save_checkpoint(FakeTrainer(), manager, state(1))
    save_checkpoint(FakeTrainer(), manager, state(2))
    # A crash between the directory rename and the pointer update leaves the pointer one behind.
    (tmp_path / "latest").write_text("step_000001\n")
    assert manager.latest().step == 2  # type: ignore[union-attr]
    (tmp_path / "latest").write_text("step_000077\n")  # names nothing complete
    assert manager.latest().step == 2  # type: ignore[union-attr]
    (tmp_path / "latest").unlink()
    assert manager.latest().step == 2  # type: ignore[union-attr]


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    save_checkpoint(FakeTrainer(), manager, state(3))
    again = StageState(step=3, cursor=DataCursor(epoch=2, position=0), num_examples=40)
    assert save_checkpoint(FakeTrainer(), manager, again).read_state() == again


def test_keep_last_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last=0"):
        CheckpointManager(tmp_path, keep_last=0)


def test_resume_state_continues_refuses_other_data_or_starts_over(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert resume_state(manager, resume=True, num_examples=40) == (StageState(num_examples=40), None)
    save_checkpoint(FakeTrainer(), manager, state(3))
    resumed, ckpt = resume_state(manager, resume=True, num_examples=40)
    assert resumed == state(3) and ckpt is not None and ckpt.step == 3
    with pytest.raises(ValueError, match="trained on 40 examples, the data now has 41"):
        resume_state(manager, resume=True, num_examples=41)
    # resume=false starts at step 0 and drops the old run's checkpoints, which would outrank the new ones.
    assert resume_state(manager, resume=False, num_examples=41) == (StageState(num_examples=41), None)
    assert manager.complete() == []


def test_epoch_order_and_batches_are_seeded_and_drop_the_partial_tail() -> None:
    # Pinned (torch's CPU randperm): the same order in every process and after a resume; the seed and the
    # epoch each change it.
    assert epoch_order(10, epoch=0, seed=1, shuffle=True) == [4, 1, 8, 6, 3, 9, 5, 7, 2, 0]
    assert epoch_order(10, epoch=0, seed=2, shuffle=True) != epoch_order(10, epoch=0, seed=1, shuffle=True)
    assert epoch_order(10, epoch=0, seed=1, shuffle=True) != epoch_order(10, epoch=1, seed=1, shuffle=True)
    assert epoch_order(4, epoch=3, seed=1, shuffle=False) == [0, 1, 2, 3]
    cursor, seen = DataCursor(), []
    for _ in range(4):  # 10 examples, batches of 4: two per epoch, the last 2 examples of each epoch dropped
        indices, cursor = next_batch(cursor, 10, 4, seed=1, shuffle=True)
        seen.append((cursor.epoch, indices))
    assert [e for e, _ in seen] == [0, 0, 1, 1]
    assert seen[0][1] + seen[1][1] == epoch_order(10, 0, 1, True)[:8]
    assert seen[2][1] == epoch_order(10, 1, 1, True)[:4] and cursor == DataCursor(epoch=1, position=8)
