"""Start a worker group on this machine, as torchrun would, and keep it whole.

    launch_local(4, ["--spec", "spec.json"])     (what ``kvbatch generate|decode --workers 4`` does)

:func:`launch_local` starts W processes of the worker entry point (``python -m kvbatch.ops.decode.worker``,
:mod:`kvbatch.ops.decode.worker`) with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (a free port) set, then supervises them: a rank that dies takes the group down and
the message names it; SIGTERM/SIGINT to the launcher go to the ranks; a rank gets SIGTERM when the
launcher itself dies (:func:`die_with_parent`). Also the exit statuses a rank and the group end
with (as the CLI's: 0 ok, 1 some rows rejected, 2 fatal).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

EXIT_OK, EXIT_REJECTS, EXIT_FATAL = 0, 1, 2
WORKER_MODULE = "kvbatch.ops.decode.worker"


def free_port() -> int:
    """A TCP port free on the loopback interface now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In a child: get SIGTERM if the launcher dies, even by SIGKILL (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch_local(world_size: int, argv: Sequence[str], *, grace_s: float = 10.0,
                 env: dict[str, str] | None = None) -> int:
    """Run ``world_size`` local processes of the worker entry point with ``argv``, as torchrun
    would; returns rank 0's exit status, or ``EXIT_FATAL`` when any rank fails.

    A rank that dies takes the group down: the others are sent SIGTERM (SIGKILL after
    ``grace_s``), and the message names the rank. SIGTERM/SIGINT to the launcher go to the
    workers too; a worker also gets SIGTERM if the launcher itself is killed.
    """
    port = free_port()
    base = {**os.environ, **(env or {})}
    # Like torchrun: one thread per worker unless told otherwise (W processes share the cores).
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    procs: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in range(world_size):
            child_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                         "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(subprocess.Popen([sys.executable, "-m", WORKER_MODULE, *argv], env=child_env,
                                          preexec_fn=die_with_parent))
        return _supervise(procs, received, grace_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, h in old.items():
            signal.signal(s, h)


def _supervise(procs: list[subprocess.Popen], received: list[int], grace_s: float) -> int:
    failed: tuple[int, int] | None = None
    while True:
        codes = [p.poll() for p in procs]
        if failed is None:
            for rank, code in enumerate(codes):
                if code is not None and code not in (EXIT_OK, EXIT_REJECTS):
                    failed = (rank, code)
                    break
        if received or failed is not None:
            break
        if all(c is not None for c in codes):
            return codes[0] if codes[0] is not None else EXIT_FATAL
        time.sleep(0.05)
    # Stop the rest: SIGTERM (already forwarded on a signal), SIGKILL after the grace period.
    for p in procs:
        if p.poll() is None and not received:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if received:
        print(f"kvbatch: error: worker group stopped by signal {received[0]}", file=sys.stderr)
        return 128 + received[0]
    assert failed is not None
    rank, code = failed
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    print(f"kvbatch: error: worker rank {rank} {how}; the group of {len(procs)} was stopped", file=sys.stderr)
    return EXIT_FATAL
