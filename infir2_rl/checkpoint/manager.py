"""Checkpoint directories that are either complete or ignored, the `latest` pointer, and keep-last-K.

Layout under RUN_DIR/checkpoints:

    step_000040/               a complete checkpoint (it has DONE)
        hf/                    HF weights + tokenizer (FP32 masters), written by trainer rank 0
        train_state/rank_K.pt  optimizer, lr schedule, RNG states, step of trainer rank K
        stage_state.json       the stage's cursor (StageState)
        MANIFEST.json          every file's size, checked at resume (verify.py)
        DONE                   written last, before the directory gets its final name
    latest                     text file: the name of the newest complete checkpoint
    .tmp_step_000050           a save in progress (or one killed mid-write): never read
    damaged_step_000060        a checkpoint that failed the checks at resume, moved aside (never read)

A save writes everything into `.tmp_step_N`, records the manifest, reads back what it wrote (verify.py:
headers and sizes, not the tensors), writes DONE, renames the directory to `step_N` (atomic on POSIX),
then replaces `latest` by an atomic rename of a temp file; older checkpoints are deleted only after that.
A save that fails (disk full, read-only directory, a trainer error) removes its temp directory before the
error goes on; a run killed at any point leaves the previous checkpoint and pointer intact, and the next
save removes the killed one's temp directory. Resume takes the newest checkpoint that passes the
checks, and says in the log why it passed over any newer one (e.g. a file truncated after the save), which
it moves aside: left among the checkpoints, its higher step outranked every later save, so keep-last
deleted each new save at once and a later resume went back to it.
Every rank must see the same directory: across nodes RUN_DIR has to be on a shared filesystem.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from infir2_rl.checkpoint.verify import problem, write_manifest

log = logging.getLogger(__name__)

DONE_FILE = "DONE"
LATEST_FILE = "latest"
STATE_FILE = "stage_state.json"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
DAMAGED_PREFIX = "damaged_"


@dataclass
class DataCursor:
    """Where the stage is in its data: epoch number and examples consumed in that epoch's order."""

    epoch: int = 0
    position: int = 0


@dataclass
class StageState:
    """What a stage needs, besides the trainer's own state, to continue exactly where it stopped."""

    # Optimizer steps completed (skipped ones included).
    step: int = 0
    cursor: DataCursor = field(default_factory=DataCursor)
    # Steps skipped by the non-finite guard so far.
    skipped_steps: int = 0
    # Training examples the order was built over; a resume on different data is refused.
    num_examples: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> StageState:
        data = json.loads(text)
        data["cursor"] = DataCursor(**data["cursor"])
        return cls(**data)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint directory."""

    step: int
    path: Path

    @property
    def hf_dir(self) -> Path:
        return self.path / "hf"

    def read_state(self) -> StageState:
        return StageState.from_json((self.path / STATE_FILE).read_text())


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def _fsync_write(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class CheckpointManager:
    """Owns RUN_DIR/checkpoints for one stage (a single writer: the stage driver)."""

    def __init__(self, root: str | Path, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={keep_last}: must be >= 1")
        self.root = Path(root)
        self.keep_last = keep_last

    def complete(self) -> list[Checkpoint]:
        """Complete checkpoints (with DONE), oldest first."""
        found = []
        if self.root.is_dir():
            for d in self.root.iterdir():
                step = d.name.removeprefix(STEP_PREFIX)
                if (
                    d.is_dir()
                    and d.name.startswith(STEP_PREFIX)
                    and step.isdigit()
                    and (d / DONE_FILE).is_file()
                ):
                    found.append(Checkpoint(int(step), d))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint that passes verification; newer ones that fail are named in the log
        and moved aside (``damaged_step_N``), so that later saves and keep-last see only what can be resumed.

        The `latest` pointer is advisory: a crash between the directory rename and the pointer update
        leaves it one behind, so the directories themselves decide.
        """
        pointer = self.root / LATEST_FILE
        if pointer.is_file():
            name = pointer.read_text().strip()
            if not (self.root / name / DONE_FILE).is_file():
                log.warning(
                    "%s names %r, which is not a complete checkpoint: scanning instead", pointer, name
                )
        complete = self.complete()
        for i in reversed(range(len(complete))):
            ckpt = complete[i]
            reason = problem(ckpt.path, STATE_FILE)
            if reason is None:
                return ckpt
            aside = self._move_aside(ckpt.path)
            log.warning(
                "checkpoint %s is damaged (%s): moved aside to %s; %s; delete it once you have looked at it",
                ckpt.path,
                reason,
                aside.name,
                "resuming from the previous complete one"
                if i
                else "no complete one is left: starting at step 0",
            )
        return None

    def _move_aside(self, path: Path) -> Path:
        """Rename a damaged checkpoint out of the step_N names (kept for a look, never read again)."""
        aside = self.root / f"{DAMAGED_PREFIX}{path.name}"
        n = 1
        while aside.exists():
            n += 1
            aside = self.root / f"{DAMAGED_PREFIX}{path.name}.{n}"
        os.rename(path, aside)
        return aside

    def begin(self, step: int) -> Path:
        """A fresh temp directory for the save of `step`; leftovers of killed saves are removed first."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f"{TMP_PREFIX}{step_dir_name(step)}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, state: StageState) -> Checkpoint:
        """Seal `tmp` as the checkpoint of `state.step`, point `latest` at it, prune old ones."""
        _fsync_write(tmp / STATE_FILE, state.to_json())
        write_manifest(tmp)
        reason = problem(tmp, STATE_FILE)  # read back what was written, before it can be resumed from
        if reason is not None:
            raise OSError(f"checkpoint save of step {state.step} in {tmp} failed verification: {reason}")
        _fsync_write(tmp / DONE_FILE, f"{state.step}\n")
        final = self.root / step_dir_name(state.step)
        if final.exists():  # the same step saved again (e.g. an end-of-stage save after a resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer_tmp = self.root / f"{TMP_PREFIX}{LATEST_FILE}"
        _fsync_write(pointer_tmp, final.name + "\n")
        os.replace(pointer_tmp, self.root / LATEST_FILE)
        self.prune()
        log.info("checkpoint saved: %s", final)
        return Checkpoint(state.step, final)

    def clear(self) -> None:
        """Delete every checkpoint (a run restarted from step 0 with checkpoint.resume=false)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def prune(self) -> None:
        """Delete complete checkpoints beyond the newest `keep_last`."""
        for old in self.complete()[: -self.keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)


class SavesCheckpoints(Protocol):
    """A trainer (or trainer group) that writes its weights and train state into a directory."""

    def save(self, directory: Path) -> None: ...


def save_checkpoint(trainer: SavesCheckpoints, manager: CheckpointManager, state: StageState) -> Checkpoint:
    """Write a complete checkpoint of `state.step`, or nothing at all if anything fails (the error goes on)."""
    tmp = manager.begin(state.step)
    try:
        trainer.save(tmp)
        return manager.commit(tmp, state)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
