"""A rollout engine that dies mid-step is replaced, given the current weights, and the rollout retried.

What happens when an engine actor dies (its process crashed, was OOM-killed, or its node went away)
while the RL loop waits on it:

1. The call fails with Ray's ``RayActorError``. Every engine is asked for ``health`` (``HEALTH_TIMEOUT_S``);
   those that are dead or do not answer are the ones to replace. If none is dead, the failure was not an
   engine's (e.g. a trainer worker died): it goes on unchanged and fails the stage.
2. The live engines are told to ``abort`` what they were generating for the failed attempt.
3. After a backoff (``FIRST_BACKOFF_S``, doubling per retry of the same step) each dead engine is killed for
   good (``ray.kill``, no restart) and a new one is created in its placement slot, loading the stage's
   starting model; the trainer's current weights (the version last pushed) are then pushed to the new
   engines only, so every engine holds the same version again.
4. The prompt order and the request counter are put back to where they were before the attempt, and
   the attempt runs again: the retried step draws the same prompts with the same per-request seeds as an
   undisturbed run would have.

At most ``MAX_STEP_RETRIES`` retries per call; past that the stage fails with ``RunFailed`` naming the
engine, and the rerun resumes from the last checkpoint. ``names.ROLLOUT_ENGINE_RESTARTS`` and
``ROLLOUT_STEP_RETRIES`` are logged every step (totals for this run of the stage). Engines die rarely enough that this costs nothing
when they do not: one Python ``try`` per call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from infir2_rl.errors import RunFailed, is_actor_death
from infir2_rl.metrics import names

if TYPE_CHECKING:
    from infir2_rl.config import RlStageConfig
    from infir2_rl.stages.rl_setup import RlActors

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_STEP_RETRIES = 3
FIRST_BACKOFF_S = 1.0
HEALTH_TIMEOUT_S = 60.0


def dead_engines(engines: list[object], timeout_s: float = HEALTH_TIMEOUT_S) -> list[int]:
    """Indices of the engine actors that are dead or do not answer ``health`` within ``timeout_s``."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    refs = [e.health.remote() for e in engines]  # type: ignore[attr-defined]
    dead = []
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=timeout_s)
        except RayActorError:
            dead.append(i)
        except GetTimeoutError:  # alive perhaps, but stuck: replaced like a dead one, and said so
            log.warning(
                "rollout engine %d did not answer health within %.0f s: treated as dead", i, timeout_s
            )
            dead.append(i)
    return dead


@dataclass
class EngineRecovery:
    """Runs rollout calls of an RL stage, replacing dead engines and retrying (module docstring)."""

    cfg: RlStageConfig
    actors: RlActors
    max_retries: int = MAX_STEP_RETRIES
    first_backoff_s: float = FIRST_BACKOFF_S
    num_engine_restarts: int = 0
    num_step_retries: int = 0

    def run(self, call: Callable[[], T], what: str) -> T:
        """``call()`` (e.g. ``manager.generate(prompts)``), retried after replacing engines that died."""
        for attempt in range(self.max_retries + 1):
            saved = (self.actors.prompts.state_dict(), self.actors.manager.state_dict())
            try:
                return call()
            except Exception as exc:
                if not is_actor_death(exc):
                    raise
                dead = dead_engines(self.actors.engines)
                if not dead:
                    raise  # not an engine: the trainer, or something else; fails the stage
                if attempt == self.max_retries:
                    raise RunFailed(
                        f"{what}: rollout engine(s) {dead} died again after {self.max_retries} replacements in"
                        " this step; check the engine logs (Ray dashboard, /tmp/ray/session_latest/logs) for"
                        " why, then rerun the same command to resume from the last checkpoint"
                    ) from exc
                backoff = self.first_backoff_s * 2**attempt
                log.warning(
                    "%s: rollout engine(s) %s died (%s); replacing them and retrying in %.0f s (retry %d of %d)",
                    what, dead, type(exc).__name__, backoff, attempt + 1, self.max_retries,
                )  # fmt: skip
                self._abort_live(dead)
                time.sleep(backoff)
                self.replace(dead)
                self.actors.prompts.load_state_dict(saved[0])
                self.actors.manager.load_state_dict(saved[1])
                self.num_step_retries += 1
        raise AssertionError("unreachable")

    def _abort_live(self, dead: list[int]) -> None:
        import ray

        live = [e for i, e in enumerate(self.actors.engines) if i not in dead]
        try:
            ray.get([e.abort.remote() for e in live], timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:  # a second death shows up at the retry's health check
            log.warning("abort of the live engines failed: %s", exc)

    def replace(self, dead: list[int]) -> None:
        """New engine actors in the slots of ``dead``, holding the trainer's current weights."""
        import ray

        from infir2_rl.actors.rollout_engine import create_engine
        from infir2_rl.weight_sync.service import WeightSyncService

        actors, new = self.actors, []
        for i in dead:
            try:
                ray.kill(actors.engines[i], no_restart=True)
            except Exception as exc:  # already gone
                log.debug("ray.kill of dead engine %d: %s", i, exc)
            engine = create_engine(self.cfg, actors.placement, i)
            for holder in (actors.engines, actors.manager.engines, actors.sync.engines):
                holder[i] = engine
            new.append(engine)
        version = actors.sync.last_version if actors.sync.last_version is not None else 0
        push = WeightSyncService(new, actors.sync.cfg, actors.sync.transport).push_from(
            actors.trainer, self.cfg.rollout_fp8, version=version
        )
        self.num_engine_restarts += len(dead)
        log.warning(
            "replaced rollout engine(s) %s and pushed weight version %d to them (%.1f MB in %.2f s)",
            dead, version, push.bytes / 1e6, push.seconds,
        )  # fmt: skip

    def metrics(self) -> dict[str, float]:
        return {
            names.ROLLOUT_ENGINE_RESTARTS: float(self.num_engine_restarts),
            names.ROLLOUT_STEP_RETRIES: float(self.num_step_retries),
        }
