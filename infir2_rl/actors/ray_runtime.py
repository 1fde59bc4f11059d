"""Connecting to Ray: the cluster in RAY_ADDRESS (set by `ray job submit`) or a local instance started here."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

from infir2_rl.env import env_flag
from infir2_rl.errors import SIGTERM_RECEIVED, BadInput, Terminated

log = logging.getLogger(__name__)


# glibc malloc settings for the actors of a local Ray instance: CPU training allocates and frees tensors
# of a few MB per op, which by default glibc maps and unmaps from the OS each time (a page fault per 4 KB
# page on every reuse). Keeping them on the heap made a tiny-model FP8 CPU train step 14% faster (936 ->
# 802 ms, 2 cores). Values already in the environment win.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a ``RAY_ADDRESS`` of the form host:port that nothing answers at, in one line: ``ray.init`` would
    retry for minutes printing only its own connection warnings. Other forms (``auto``, ``ray://...``,
    ``http://...``) are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise BadInput(
            f"RAY_ADDRESS={address!r}: write it as HOST:PORT of a Ray head's GCS (e.g. 10.0.0.1:6379), auto, or"
            " unset it to start a local Ray"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise BadInput(
            f"RAY_ADDRESS={address!r}: nothing answers there ({exc.strerror or exc}); start the head"
            " (`ray start --head`) or unset RAY_ADDRESS to start a local Ray"
        ) from exc


def ensure_ray() -> None:
    """Connect to the cluster in RAY_ADDRESS (set by `ray job submit`) or start a local Ray instance."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        check_ray_address(address)
        ray.init(address=address, log_to_driver=True)
    else:
        from infir2_rl.actors.ray_watch import choose_local_auth_mode, watch_instructions

        auth_mode = choose_local_auth_mode()
        dashboard = env_flag("INFIR2_RAY_DASHBOARD", True)
        env = {k: os.environ.get(k, v) for k, v in MALLOC_ENV.items()}
        context = ray.init(
            num_cpus=_affinity_cpus(),
            include_dashboard=dashboard,
            log_to_driver=True,
            runtime_env={"env_vars": env},
        )
        dashboard_url = context.dashboard_url if dashboard else None
        gcs_address = ray.get_runtime_context().gcs_address
        node = ray._private.worker._global_node  # the node this driver started; holds the session dir
        assert node is not None
        session_dir = node.get_session_dir_path()
        log.info("%s", watch_instructions(dashboard_url or None, gcs_address, auth_mode, session_dir))
    log.info("Ray resources: %s", ray.cluster_resources())
    raise_on_sigterm()


def cluster_gone(timeout_s: float = 2.0) -> bool:
    """Whether this driver's Ray cluster has gone: its GCS refuses or does not answer a TCP connect within
    ``timeout_s``. A stop signal sent to the command's whole process group (``timeout``, ``kill -TERM -PGID``)
    also ends the GCS and raylet of a local Ray, which share that group; the teardown's Ray calls (actor stops,
    removing the placement group) then each waited 60 s for the GCS until Ray aborted the process with exit
    1 and none of our line. Teardown asks this first and skips what needs the cluster."""
    import ray

    if not ray.is_initialized():
        return True
    try:
        host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    except Exception:  # noqa: BLE001 - e.g. a Ray Client connection (ray://) has no GCS address here
        return False  # cannot tell: teardown goes on as usual
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError:
        return True
    return False


def raise_on_sigterm() -> None:
    """Make SIGTERM end the command like Ctrl-C: one line, stage.log, exit 143 (errors.Terminated).

    ray.init leaves SIGTERM to Ray's core worker, which logs a stack dump and then calls the handler ray.init
    set in Python, ``sys.exit(15)``: the command died with the dump and no line of ours (a user saw exit 134).
    This replaces both, in the main thread only (Python's rule for signal handlers).
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: object) -> None:
        SIGTERM_RECEIVED[0] = True
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


def _affinity_cpus() -> int | None:
    """The CPUs this process may run on when that is fewer than the machine's (``taskset``), else None
    (Ray's own count, which honours cgroup quotas). Ray counts every core of the machine even when the
    process is pinned, and then starts as many idle workers and admits as many actors as there are cores:
    eight pinned 2-core pipelines on a 16-core machine each started 16 workers and stalled."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is None:
        return None
    n = len(affinity(0))
    return n if n < (os.cpu_count() or n) else None
