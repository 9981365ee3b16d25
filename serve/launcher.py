"""Starts batches' pipeline runs on this machine, with no daemon to start by hand: a worker
process (:mod:`kvbatch.serve.worker`), started with the server and kept warm, executes each
batch's ``kvbatch_batch_api`` run in the Dagster instance of ``DAGSTER_HOME``, so every run is
recorded there and shows in the UI.

The worker imports torch and Dagster once and keeps the model loaded, so a batch starts in about
a second instead of paying the imports each time; batches queue on it and run one after
another (each run uses every core the engine is given). A launch returns a handle (host, pid)
that the batch record keeps, so a restarted server can tell a run that is still going (leave it)
from one that died with the old server (start another).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any, Protocol

WORKER_MODULE = "kvbatch.serve.worker"


class Launcher(Protocol):
    def launch(self, batch_id: str, input_url: str, work_url: str, chunk_rows: int,
               endpoint: str | None = None) -> dict[str, Any]:
        """Start (or queue) the run; returns the handle the batch record keeps. ``endpoint``: the
        batch's, which every row's ``url`` must name."""

    def alive(self, handle: dict[str, Any] | None) -> bool:
        """Whether the run of ``handle`` may still be going (when unsure: True)."""


def log_path() -> str:
    home = os.environ.get("DAGSTER_HOME") or tempfile.gettempdir()
    os.makedirs(os.path.join(home, "kvbatch_serve_logs"), exist_ok=True)
    return os.path.join(home, "kvbatch_serve_logs", "worker.log")


class LocalLauncher:
    """The warm worker on this host. Jobs go to it over its stdin, so the URLs never appear on a
    command line (``ps`` shows those to every user); the API keys are not in its environment."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the worker now, so that its imports are done before the first batch arrives."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = {k: v for k, v in os.environ.items() if k != "KVBATCH_API_KEYS"}
            with open(log_path(), "ab") as log:
                # Its own session: a Ctrl-C or SIGTERM meant for the server does not kill running
                # batches; when the server goes, the queue closes and the worker drains it and exits.
                self._proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                              stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True)
        return self._proc

    def launch(self, batch_id: str, input_url: str, work_url: str, chunk_rows: int,
               endpoint: str | None = None) -> dict[str, Any]:
        job = {"batch_id": batch_id, "input_url": input_url, "work_url": work_url, "chunk_rows": chunk_rows,
               "endpoint": endpoint}
        with self._lock:
            proc = self._ensure()
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(job) + "\n").encode())
            proc.stdin.flush()
        return {"host": socket.gethostname(), "pid": proc.pid}

    def alive(self, handle: dict[str, Any] | None) -> bool:
        if not handle:
            return False
        if handle.get("host") != socket.gethostname():
            return True  # not ours to judge
        pid = int(handle["pid"])
        with self._lock:
            if self._proc is not None and self._proc.pid == pid:
                return self._proc.poll() is None
        try:  # a worker of an earlier server: it finishes the jobs it was given, then exits
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return WORKER_MODULE.encode() in f.read()
        except FileNotFoundError:
            return False
        except OSError:
            return True

    def stop(self) -> None:
        """Close the worker's queue: it finishes the runs it was given, then exits."""
        with self._lock:
            if self._proc is not None and self._proc.stdin is not None:
                self._proc.stdin.close()
