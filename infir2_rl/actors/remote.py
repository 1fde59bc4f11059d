"""Call a method on many engines at once, whether they are Ray actor handles or local objects.

Ray handles get ``handle.method.remote(*args)`` and all refs are fetched with one ``ray.get`` (never a
``ray.get`` per item); local objects (unit tests, single-process tools) are called directly, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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


def _resolve(value: Any) -> Any:
    if is_object_ref(value):
        import ray

        return ray.get(value)
    return value
