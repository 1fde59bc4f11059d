"""Run math-verify in a child process that can be killed, so one answer can never hang a run.

Why a process and not math-verify's own timeout: math-verify guards `parse` and `verify` with
`signal.alarm`, which only works in the main thread of the main interpreter (it raises inside Ray
actors with `max_concurrency > 1`, async actors and any helper thread). Worse, a signal handler
only runs between Python bytecodes, so an answer like `9^{9^{9^{9}}}` that sympy hands to a single
big-integer power inside C is not interrupted even in the main thread. A child process can always
be killed: we send it one request per line on stdin, wait for one line on stdout with a deadline,
and SIGKILL it (then start a fresh one on the next call) when the deadline passes.

Cost: one pipe round trip per answer (well under a millisecond) on top of math-verify's own work
(about 2 ms for a simple number), and one interpreter start (about 1 s, 1.6-1.8 s on a loaded 2-core
machine) per guard and per timeout. The replacement of a killed child is started at once, so its start
overlaps whatever the caller does before the next answer (``MathReward`` keeps spare guards for this).
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref

# Source of the child. Run with `python -c` rather than as a file: running a file from this folder
# would put the folder on sys.path and our `math.py` would shadow the standard library's `math`.
_WORKER_SOURCE = r"""
import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
import ctypes, json, logging, os, signal
try:  # Linux: die with the parent even while stuck in a long computation.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except Exception:
    pass
# Keep the protocol channel private: anything a library prints goes to stderr.
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
from math_verify import parse, verify
logging.getLogger("math_verify").setLevel(logging.CRITICAL)
def check(pred, gold):
    gold_parsed = parse(gold, parsing_timeout=None)
    pred_parsed = parse(pred, parsing_timeout=None)
    return bool(gold_parsed) and bool(pred_parsed) and verify(gold_parsed, pred_parsed, timeout_seconds=None)
check("\\boxed{1/2}", "\\boxed{0.5}")  # warm up sympy and the LaTeX parser before saying ready
out.write("ready\n"); out.flush()
for line in sys.stdin:
    try:
        request = json.loads(line)
        answer = "1" if check(request["pred"], request["gold"]) else "0"
    except Exception as exc:
        print(f"math-verify worker error: {type(exc).__name__}: {exc}", file=sys.stderr)
        answer = "e"
    out.write(answer + "\n"); out.flush()
"""


class _Deadline(Exception):
    """The child did not answer in time."""


class _ChildExited(Exception):
    """The child closed its stdout (it exited or was killed)."""


class Verdict(enum.Enum):
    """Outcome of one guarded comparison."""

    CORRECT = "correct"
    WRONG = "wrong"
    TIMEOUT = "timeout"
    ERROR = "error"


class VerifyGuard:
    """One math-verify child process with a per-answer deadline; thread-safe, restarts after a kill.

    `check(pred, gold)` takes LaTeX strings math-verify can parse (e.g. `\\boxed{1/2}`).
    The child is started lazily on the first call; `startup_timeout_s` bounds its start separately
    from `timeout_s`, so the import cost is never mistaken for a slow answer.
    """

    def __init__(self, timeout_s: float = 3.0, startup_timeout_s: float = 120.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 seconds; use e.g. 3.0.")
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False  # the child said "ready" (it may still be importing after a restart)
        self._buffer = b""
        _LIVE_GUARDS.add(self)

    def check(self, pred: str, gold: str) -> Verdict:
        request = (json.dumps({"pred": pred, "gold": gold}) + "\n").encode()
        with self._lock:
            # A second attempt only after the child died: on Linux it is killed when the thread that
            # started it exits (PR_SET_PDEATHSIG follows the thread), e.g. a finished thread-pool worker.
            for attempt in range(2):
                proc = self._ensure_started()
                try:
                    assert proc.stdin is not None
                    proc.stdin.write(request)
                    proc.stdin.flush()
                    line = self._read_line(self.timeout_s)
                except (_ChildExited, BrokenPipeError):
                    self._kill()
                    if attempt == 0:
                        continue
                    return Verdict.ERROR
                except _Deadline:
                    self._kill()
                    self._spawn()  # the replacement boots now, ready (or nearly) by the next call
                    return Verdict.TIMEOUT
                return {b"1": Verdict.CORRECT, b"0": Verdict.WRONG}.get(line, Verdict.ERROR)
        raise AssertionError("unreachable")

    @property
    def ready(self) -> bool:
        """True when the child is running and has finished starting (the next check starts at once)."""
        return self._ready and self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Stop the child process (a later `check` starts a new one)."""
        with self._lock:
            self._kill()

    def start_soon(self) -> None:
        """Start the child now without waiting for it (the first check waits); several start in parallel."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._spawn()

    def _spawn(self) -> None:
        """Start a child without waiting for it to say ready (``_ensure_started`` waits)."""
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_SOURCE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self._ready = False

    def _ensure_started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None and self._ready:
            return self._proc
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._spawn()
        try:
            line = self._read_line(self.startup_timeout_s)
        except (_ChildExited, _Deadline):
            line = b""
        if line != b"ready":
            self._kill()
            raise RuntimeError(
                "The math-verify worker process did not start (see its error above on stderr); "
                f"check that `{sys.executable} -c 'import math_verify'` works."
            )
        self._ready = True
        assert self._proc is not None
        return self._proc

    def _read_line(self, timeout_s: float) -> bytes:
        """One stdout line from the child without the newline; raises _Deadline or _ChildExited."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Deadline
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise _Deadline
            chunk = os.read(fd, 4096)
            if not chunk:  # EOF: the child exited
                raise _ChildExited
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.strip()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        self._buffer, self._ready = b"", False
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    def __del__(self) -> None:
        # Best effort only: interpreter shutdown may already have torn down what _kill needs.
        with contextlib.suppress(Exception):
            self._kill()


_LIVE_GUARDS: weakref.WeakSet[VerifyGuard] = weakref.WeakSet()


@atexit.register
def _close_all_guards() -> None:
    for guard in list(_LIVE_GUARDS):
        guard.close()
