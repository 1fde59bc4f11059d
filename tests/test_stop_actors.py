"""``actors.remote.stop_actors``: an idle actor exits on its own (graceful, no signal that could land inside a
garbage-collector callback and print a traceback), a busy one is killed after the timeout, and non-actors
are ignored (CPU, a local Ray)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import ray

from infir2_rl.actors.remote import gather, stop_actors


@ray.remote(num_cpus=0)
class _Sleeper:
    def ping(self) -> int:
        return os.getpid()

    def sleep(self, s: float) -> None:
        time.sleep(s)

    def fail_after(self, s: float) -> None:
        time.sleep(s)
        raise RuntimeError("Read error: the peer closed the connection")

    def die_after(self, s: float) -> None:
        time.sleep(s)
        os._exit(1)


@ray.remote(num_cpus=0)
class _Closer:
    """An actor with ``close``: it writes a file (so the test sees it ran), or fails when told to."""

    def __init__(self, path: str, fail: bool) -> None:
        self.path, self.fail = path, fail

    def ping(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self.fail:
            raise RuntimeError("the group was already gone")
        with open(self.path, "w") as f:
            f.write("closed")


def _dead(actor: object) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=30)  # type: ignore[attr-defined]
    except ray.exceptions.RayActorError:
        return True
    return False


@pytest.mark.usefixtures("ray_local")
def test_idle_actors_exit_and_busy_ones_are_killed_after_the_timeout() -> None:
    idle, busy = _Sleeper.remote(), _Sleeper.remote()  # type: ignore[attr-defined]
    ray.get([idle.ping.remote(), busy.ping.remote()])
    busy.sleep.remote(600)
    start = time.perf_counter()
    stop_actors([idle, busy, object()], timeout_s=2.0)
    took = time.perf_counter() - start
    assert _dead(idle) and _dead(busy)
    assert 1.5 < took < 60  # waited for the busy one, then killed it
    start = time.perf_counter()
    stop_actors([_Sleeper.remote()], timeout_s=30.0)  # type: ignore[attr-defined]
    assert time.perf_counter() - start < 25  # an idle actor does not wait out the timeout
    stop_actors([])


@pytest.mark.usefixtures("ray_local")
def test_gather_raises_a_ranks_death_over_the_error_it_caused_in_a_peer() -> None:
    """Rank 0 fails first (what a gloo peer of a killed rank sees), rank 1's actor dies after: ``ray.get``
    raises rank 0's error; ``gather`` the death, chained to that error."""
    ranks = [_Sleeper.remote(), _Sleeper.remote()]  # type: ignore[attr-defined]
    ray.get([r.ping.remote() for r in ranks])
    with pytest.raises(ray.exceptions.RayTaskError, match="Read error"):
        ray.get([ranks[0].fail_after.remote(0.0), ranks[1].die_after.remote(1.0)])
    ranks[1] = _Sleeper.remote()  # type: ignore[attr-defined]
    with pytest.raises(ray.exceptions.RayActorError) as died:
        gather([ranks[0].fail_after.remote(0.0), ranks[1].die_after.remote(1.0)])
    assert "Read error" in str(died.value.__cause__)
    assert gather([r.ping.remote() for r in [_Sleeper.remote(), _Sleeper.remote()]])  # type: ignore[attr-defined]
    with pytest.raises(ray.exceptions.RayTaskError, match="Read error"):  # no death: the failure itself
        gather([ranks[0].fail_after.remote(0.0), ranks[0].ping.remote()], grace_s=1.0)


@pytest.mark.usefixtures("ray_local")
def test_actors_are_closed_before_they_stop_and_a_failed_close_stops_them_anyway(tmp_path: object) -> None:
    closed = f"{tmp_path}/closed"
    ok, failing, plain = _Closer.remote(closed, False), _Closer.remote("", True), _Sleeper.remote()  # type: ignore[attr-defined]
    ray.get([ok.ping.remote(), failing.ping.remote(), plain.ping.remote()])
    stop_actors([ok, failing, plain], timeout_s=10.0)
    assert Path(closed).read_text() == "closed"
    assert _dead(ok) and _dead(failing) and _dead(plain)
