"""Call a method on many engines at once, whether they are Ray actor handles or local objects.

Ray handles get ``handle.method.remote(*args)`` and all refs are fetched with one ``ray.get`` (never a
``ray.get`` per item); local objects (unit tests, single-process tools) are called directly, in order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def is_actor(handle: object) -> bool:
    try:
        from ray.actor import ActorHandle
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(handle, ActorHandle)


def is_object_ref(value: object) -> bool:
    try:
        from ray import ObjectRef
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, ObjectRef)


@dataclass
class Call:
    """``target.method(*args)``; ``args`` may hold Ray ObjectRefs, which Ray resolves for actors."""

    target: Any
    method: str
    args: tuple[Any, ...] = ()


def call_all(calls: Sequence[Call], timeout_s: float | None = None) -> list[Any]:
    """Run every call and return the results in order. Actor calls run concurrently.

    Local targets receive ObjectRef arguments already resolved (as Ray would do for an actor).
    Raises ``ray.exceptions.GetTimeoutError`` past ``timeout_s``; an actor's exception is re-raised.
    """
    results: list[Any] = [None] * len(calls)
    remote_slots: list[int] = []
    refs: list[Any] = []
    for i, call in enumerate(calls):
        if is_actor(call.target):
            refs.append(getattr(call.target, call.method).remote(*call.args))
            remote_slots.append(i)
    if refs:
        import ray

        for i, value in zip(remote_slots, ray.get(refs, timeout=timeout_s)):
            results[i] = value
    for i, call in enumerate(calls):
        if not is_actor(call.target):
            args = tuple(_resolve(a) for a in call.args)
            results[i] = getattr(call.target, call.method)(*args)
    return results


# How long ``gather`` waits, after a call failed, for the other calls to show whether one of their actors died.
DEATH_GRACE_S = 10.0


def gather(refs: Sequence[Any], grace_s: float = DEATH_GRACE_S) -> list[Any]:
    """``ray.get(refs)`` of calls to the ranks of one group, except that when a call fails and another call's
    actor died, the death is raised (chained to the first failure). A rank killed inside a collective makes its
    peers fail as well, often first (gloo "Read error", a closed connection), and ``ray.get`` raises the first
    failure it sees; only the death names the cause, which ``errors.describe`` turns into "<actor> died ...
    rerun the same command to resume" (seen under load: the surviving rank's gloo error surfaced instead)."""
    import ray
    from ray.exceptions import RayActorError

    try:
        return list(ray.get(list(refs)))
    except RayActorError:
        raise
    except Exception as first:
        deadline = time.monotonic() + grace_s
        for ref in refs:
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except RayActorError as death:
                raise death from first
            except Exception:  # this call's own failure, or still running at the deadline
                continue
        raise


def _resolve(value: Any) -> Any:
    if is_object_ref(value):
        import ray

        return ray.get(value)
    return value


def stop_actors(actors: Sequence[Any], timeout_s: float = 5.0) -> None:
    """Stop Ray actors: ``close()`` first on those that have one (a rollout engine shuts down its side of the
    weight group; torch printed "destroy_process_group() was not called before program exit" from every
    engine of a disaggregated run without it), then a graceful exit (each finishes the task it runs, then
    exits through ``exit_actor``), then ``ray.kill`` for any still alive; each step waits at most ``timeout_s``.
    A ``close`` that fails is logged, and the actor is stopped all the same.

    ``ray.kill`` alone ends a worker with a signal whose handler raises ``SystemExit`` wherever the worker is,
    and when that was inside a garbage-collector callback (fp8/ops.py's weak-reference cache) the stage's
    output showed "Exception ignored ... SystemExit" tracebacks from a normal shutdown.
    """
    import ray

    from infir2_rl.actors.ray_runtime import cluster_gone

    actors = [a for a in actors if is_actor(a)]
    if not actors:
        return
    if cluster_gone():  # a stop signal to the whole process group ended the local Ray with the actors
        log.warning("Ray's cluster has gone (its GCS does not answer): %d actors not stopped", len(actors))
        return
    closing = [a.close.remote() for a in actors if hasattr(a, "close")]
    done, _ = ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
    for ref in done:
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - stopping anyway; the cause is worth a line
            log.warning("an actor's close() failed before it was stopped: %s", str(exc).splitlines()[0])
    refs = [a.__ray_terminate__.remote() for a in actors]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for a in actors:
        ray.kill(a)  # a no-op for an actor that has exited
