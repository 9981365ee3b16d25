"""Soak: `kvbatch serve` with its state on S3 (moto on loopback), many batches submitted at once,
the server killed twice while they run (once alone, its worker going on; once with every batch
worker, as a machine crash), through the official ``openai`` client.

What must hold: every batch ends ``completed``, every output row exactly once and in input order,
no batch left ``in_progress``, and the server's memory flat while it drives the batches (its RSS when
every batch is done within ``RSS_GROWTH_BOUND`` of its RSS at its first finished batch).

Scaled for CI's 2-core machines: the tiny chat model (a random 2-layer Llama, hidden size 64),
``max_tokens`` 2, so the 20 x 50 rows decode in seconds and the test's time goes to what it checks (the runs, the kills, the
recovery), not to decoding.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from tests.test_serve import KEY_A, _lines, _row, serve_tiny_model

BATCHES, ROWS = 20, 50
# Bytes. Measured growth is under 1 MiB; a leak of 4 MiB per batch over the ~16 batches the last
# server drives would exceed it.
RSS_GROWTH_BOUND = 64 << 20
WAIT_S = 600


def _rss(pid: int) -> int:
    """Resident bytes of a process (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _workers(server) -> list[int]:
    """The batch workers of this server's Dagster home (of the server running now and of earlier
    ones: a worker outlives the server that started it until its queue is done)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"kvbatch.serve.worker" not in cmdline.read_bytes():
                continue
            environ = (cmdline.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DAGSTER_HOME={server.env['DAGSTER_HOME']}".encode() in environ:
            found.append(int(cmdline.parent.name))
    return found


@pytest.fixture
def soak_server(tmp_path, s3_endpoint):
    import s3fs

    bucket = f"soak-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=s3_endpoint).mkdir(bucket)
    (tmp_path / "serve").mkdir()
    yield from serve_tiny_model(tmp_path / "serve", KVBATCH_ROOT=f"s3://{bucket}/kvbatch",
                                KVBATCH_S3_ENDPOINT_URL=s3_endpoint, AWS_ACCESS_KEY_ID="testing",
                                AWS_SECRET_ACCESS_KEY="testing", KVBATCH_API_KEYS=KEY_A)


@pytest.mark.slow
def test_batches_at_once_two_server_kills_every_row_once_memory_flat(soak_server, tmp_path):
    server = soak_server
    client = server.client(KEY_A)
    ids = []
    for b in range(BATCHES):
        path = tmp_path / f"in-{b}.jsonl"
        path.write_text("\n".join(_row(f"b{b}-r{i}", content=f"Say {i} of {b}", max_tokens=2, ignore_eos=True)
                                  for i in range(ROWS)) + "\n")
        with open(path, "rb") as f:
            file_id = client.files.create(file=f, purpose="batch").id
        ids.append(client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)

    def statuses() -> dict[str, str]:
        return {b.id: b.status for b in client.batches.list(limit=100).data if b.id in ids}

    def wait_until(done_at_least: int) -> dict[str, str]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            now = statuses()
            if sum(s == "completed" for s in now.values()) >= done_at_least or any(
                    s in ("failed", "cancelled", "expired") for s in now.values()):
                return now
            time.sleep(0.2)
        raise AssertionError(f"stuck: {statuses()}")

    # Kill 1: the server alone, once a batch is done; its worker (a session of its own) goes on.
    wait_until(1)
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    server.start()
    client = server.client(KEY_A)
    # Kill 2: the server and every worker together, a few batches later, as a machine crash (the
    # runs in flight and the queue the worker held are lost: the next server must start them again).
    wait_until(3)
    workers = _workers(server)
    assert workers, "no batch worker to kill"
    for pid in workers:
        os.killpg(pid, signal.SIGKILL)  # each worker leads a session of its own
    server.kill_all()
    server.start()
    client = server.client(KEY_A)
    wait_until(sum(s == "completed" for s in statuses().values()) + 1)
    rss_first = _rss(server.proc.pid)
    final = wait_until(BATCHES)

    assert sorted(final.values()) == ["completed"] * BATCHES, (final, server.log.read_text()[-3000:])
    for b, batch_id in enumerate(ids):
        batch = client.batches.retrieve(batch_id)
        assert batch.request_counts.completed == batch.request_counts.total == ROWS, batch
        out = [o["custom_id"] for o in _lines(client, batch.output_file_id)]
        assert out == [f"b{b}-r{i}" for i in range(ROWS)], batch_id  # every row once, in input order
        assert _lines(client, batch.error_file_id) == []
    rss_end = _rss(server.proc.pid)
    print(f"soak: server RSS {rss_first / 2**20:.1f} MiB at its first finished batch, "
          f"{rss_end / 2**20:.1f} MiB at the end")
    assert rss_end - rss_first <= RSS_GROWTH_BOUND, (rss_first, rss_end)
    assert "Traceback" not in server.log.read_text()
    # Nothing left in_progress in the state itself either (the records on S3, read afresh).
    import s3fs

    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=server.env["KVBATCH_S3_ENDPOINT_URL"],
                           skip_instance_cache=True)
    root = server.env["KVBATCH_ROOT"].removeprefix("s3://")
    records = [json.loads(fs.cat_file(p)) for p in fs.find(f"{root}/batch_api/batches")]
    assert sorted(r["object"]["status"] for r in records if r["object"]["id"] in ids) == ["completed"] * BATCHES
    assert max(r["attempts"] for r in records) >= 2  # the crash really cost runs, which were started again
