"""How a failed command ends: one line naming the cause and the remedy, and a documented exit code.

Exit codes of ``infir2-rl`` (README, docs/reliability.md):

    0    success
    1    the run failed: a stage that trained nothing, too many non-finite steps in a row, a trainer
         worker or Ray actor that died, a full disk, or an error of unknown cause
    2    bad input, nothing trained: config values, paths, data files, a run directory that cannot
         be written, a resume refused because the config changed
    130  interrupted (Ctrl-C); the last checkpoint is intact and the same command resumes from it
    143  terminated (SIGTERM: kill, timeout, a job scheduler), likewise

``describe(exc)`` turns any exception into (exit code, one line). Exceptions raised inside Ray actors
arrive wrapped (``RayTaskError``, whose text holds the remote traceback): the line is built from the
original exception. The full traceback is kept for ``-v`` and for the log file; the terminal gets the line.
This module imports nothing of the package (Ray only inside ``describe``), so anything may raise its types.
"""

from __future__ import annotations

import errno
import re

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM

# Longest line printed for one error (a message quoting a whole config would flood the terminal).
MAX_LINE_CHARS = 600
RESUME_HINT = "rerun the same command to resume from the last checkpoint"


class RunFailed(RuntimeError):
    """The run failed for a known cause; the message names the cause and what to do (exit code 1)."""


class BadInput(ValueError):
    """Input that cannot be run (exit code 2); the message names the field or file and the fix."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (``actors/ray_runtime.raise_on_sigterm``): the command ends as on Ctrl-C, exit code 143.
    A KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""


# Set by the SIGTERM handler. Ray's ``ray.get`` checks signals itself and turns any KeyboardInterrupt raised by
# a handler into a fresh, plain ``KeyboardInterrupt`` (``_raylet.check_signals``), so a SIGTERM that lands
# while the driver waits on Ray arrives without the ``Terminated`` class: this flag still tells them apart.
SIGTERM_RECEIVED = [False]


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, stripped and bounded in length."""
    for line in str(text).splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 3] + "..."
    return ""


def _actor_death(exc: BaseException) -> str:
    """'TrainerWorker (pid 123) died: <Ray's reason>' from the text of a RayActorError."""
    text = str(exc)
    cls = re.search(r"class_name: (\S+)", text)
    pid = re.search(r"pid: (\d+)", text)
    who = cls.group(1) if cls else "a Ray actor"
    if pid:
        who += f" (pid {pid.group(1)})"
    reason = re.search(r"(The actor is dead because[^.]*\.)", text)
    exit_detail = re.search(r"Worker exit detail: ([^.]*\.)", text)
    parts = [p.group(1) for p in (reason, exit_detail) if p]
    return f"{who} died: " + (" ".join(parts) if parts else first_line(text)).rstrip(".")


def _remote_cause(exc: BaseException) -> BaseException | None:
    """The exception raised inside a Ray task or actor method, when ``exc`` wraps one."""
    try:
        from ray.exceptions import RayTaskError
    except ImportError:  # pragma: no cover - Ray is a dependency
        return None
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        return cause if isinstance(cause, BaseException) else None
    return None


def is_actor_death(exc: BaseException) -> bool:
    """Whether ``exc`` is Ray's report that an actor died (``RayActorError``)."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, RayActorError)


def describe(exc: BaseException) -> tuple[int, str]:
    """(exit code, one line naming the cause and the remedy) for an exception that ended a command."""
    if isinstance(exc, Terminated) or SIGTERM_RECEIVED[0]:
        # Whatever surfaced once a SIGTERM came: sent to the process group it also ends the local Ray, and a Ray
        # error from a call in flight (or from teardown, replacing our Terminated) ended the command with exit 1.
        return EXIT_TERMINATED, f"terminated (SIGTERM); {RESUME_HINT}"
    remote = _remote_cause(exc)
    if remote is not None:
        code, line = describe(remote)
        return code, line if "Ray actor" in line else f"{line} (raised in a Ray actor)"
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, f"interrupted; {RESUME_HINT}"
    if is_actor_death(exc):
        return EXIT_FAILED, (
            f"{_actor_death(exc)}; its log is under /tmp/ray/session_latest/logs (or the dashboard); "
            f"{RESUME_HINT}"
        )
    if isinstance(exc, RunFailed):
        return EXIT_FAILED, first_line(str(exc))
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        where = f" writing {exc.filename}" if exc.filename else ""
        return (
            EXIT_FAILED,
            f"disk full{where}: free space or use a run_dir on a larger disk, then {RESUME_HINT}",
        )
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        where = f" {exc.filename}" if exc.filename else ""
        return EXIT_BAD_INPUT, (
            f"cannot write{where} ({exc.strerror}): make the run directory writable or set run_dir= to one that is"
        )
    if (
        isinstance(exc, (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError))
        and exc.filename
    ):
        # the OS's "[Errno 20] Not a directory: '...'": said as the path and what to do
        return EXIT_BAD_INPUT, (
            f"{exc.filename}: {exc.strerror or type(exc).__name__}; choose another path (run_dir=, --out,"
            " --output) or fix the one on the way"
        )
    if isinstance(exc, (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError)):
        return EXIT_BAD_INPUT, first_line(str(exc))
    message = first_line(str(exc))
    return EXIT_FAILED, f"{type(exc).__name__}: {message}" if message else type(exc).__name__
