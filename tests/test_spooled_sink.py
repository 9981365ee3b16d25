"""``AtomicSink(spool=True)``: an object-store output written to a local file and uploaded at
commit, so a step holding many outputs open (the shard writer) keeps no upload buffer in memory
per output; nothing is visible on the store before the commit, and an abort leaves nothing."""

from __future__ import annotations

import boto3
import pytest

from kvbatch.io.batch_output import AtomicSink

CHUNK = b"0123456789abcdef" * 65536  # 1 MiB


def _uploads(opts: dict, bucket: str) -> list:
    client = boto3.client("s3", endpoint_url=opts["endpoint_url"], aws_access_key_id=opts["key"],
                          aws_secret_access_key=opts["secret"], region_name="us-east-1")
    return client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


@pytest.fixture
def spool_dir(tmp_path, monkeypatch):
    folder = tmp_path / "spool"
    folder.mkdir()
    monkeypatch.setenv("KVBATCH_SPOOL_DIR", str(folder))
    return folder


def test_a_spooled_s3_output_is_local_until_its_commit_then_one_object(s3, spool_dir):
    url, opts, fs = s3
    bucket = url.split("/")[2]
    sink = AtomicSink(f"{url}/big.bin", opts, spool=True)
    for _ in range(12):
        sink.write(CHUNK)
    # 12 MiB written: all of it in the spool file, none of it on the store or in an upload.
    (spooled,) = spool_dir.iterdir()
    assert spooled.stat().st_size == 12 * len(CHUNK)
    assert not fs.exists(f"{url}/big.bin") and _uploads(opts, bucket) == []
    sink.commit()
    fs.invalidate_cache()
    assert fs.cat_file(f"{url}/big.bin") == CHUNK * 12
    assert list(spool_dir.iterdir()) == [] and _uploads(opts, bucket) == []


def test_an_aborted_spooled_output_leaves_nothing(s3, spool_dir):
    url, opts, fs = s3
    sink = AtomicSink(f"{url}/gone.bin", opts, spool=True)
    sink.write(CHUNK)
    sink.abort()
    fs.invalidate_cache()
    assert not fs.exists(f"{url}/gone.bin") and list(spool_dir.iterdir()) == []


def test_a_spooled_output_replaces_the_previous_object_whole(s3, spool_dir):
    url, opts, fs = s3
    fs.pipe_file(f"{url.split('://', 1)[1]}/t.bin", b"old")
    sink = AtomicSink(f"{url}/t.bin", opts, spool=True)
    sink.write(b"new " * 10)
    fs.invalidate_cache()
    assert fs.cat_file(f"{url}/t.bin") == b"old"  # the reader sees the last commit meanwhile
    sink.commit()
    fs.invalidate_cache()
    assert fs.cat_file(f"{url}/t.bin") == b"new " * 10


def test_spool_on_a_local_path_is_the_plain_local_sink(tmp_path, spool_dir):
    # A local output is already a temp file renamed at commit: spool changes nothing there.
    sink = AtomicSink(str(tmp_path / "x.bin"), None, spool=True)
    sink.write(b"abc")
    assert list(spool_dir.iterdir()) == []
    sink.commit()
    assert (tmp_path / "x.bin").read_bytes() == b"abc"
