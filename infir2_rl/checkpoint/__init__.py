"""Save/resume: HF weights + per-rank train state, atomic directories, `latest` pointer, keep-last-K."""

from infir2_rl.checkpoint.manager import (
    Checkpoint,
    CheckpointManager,
    DataCursor,
    SavesCheckpoints,
    StageState,
    save_checkpoint,
)

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "DataCursor",
    "SavesCheckpoints",
    "StageState",
    "save_checkpoint",
]
