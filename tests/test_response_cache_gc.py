"""GC of the response cache by last use (ops/decode/response_cache_gc.py, docs/response-cache.md
"Retention"): a run records the entries it served in a few usage files (never a write per hit);
gc deletes the entries unused for N days, then the least recently used beyond a size, and folds the
usage files; an entry gc deleted under a reader is a miss, never an error; its requests are bounded
(counted, and checked against the HTTP requests a real S3 endpoint received)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from kvbatch.cli.main import main
from kvbatch.engine.runtime.llm import Result
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.ops.decode import response_cache_gc as rcgc
from kvbatch.ops.decode.response_cache import ResponseCache, row_key

DAY = 86400.0


def _keys(n: int) -> list[str]:
    return [row_key("engine", [i, i + 1], SamplingParams(max_tokens=4, temperature=0.0)) for i in range(n)]


def _result(i: int) -> Result:
    return Result(str(i), [i, i + 1], [7, 8, i], f"answer {i}", "length", 0, 0.1, 0.01)


def _fill(url: str, keys: list[str], **opts) -> None:
    cache = ResponseCache(url, "engine", storage_options=opts or None)
    for i, key in enumerate(keys):
        cache.put(key, _result(i))
    cache.close()
    assert cache.stats.writes == len(keys)


def _age(folder: Path, days: float) -> None:
    """Every entry written ``days`` ago (its modification time is its write)."""
    t = time.time() - days * DAY
    for p in (folder / "responses" / "v1").rglob("*.json"):
        os.utime(p, (t, t))


def test_entries_used_later_survive_and_unused_ones_go(tmp_path):
    url, keys = str(tmp_path / "cache"), _keys(4)
    _fill(url, keys)
    _age(tmp_path / "cache", 3)
    # A later run serves two of them: one usage file for the run, whatever its hits.
    reader = ResponseCache(url, "engine")
    assert set(reader.lookup_many(keys[:2])) == set(keys[:2])
    reader.close()
    assert reader.stats.usage_files == 1 and reader.to_json()["requests"] == {"GET": 2, "PUT": 1}
    out = rcgc.gc_responses(rcgc.open_layout(url), unused_s=DAY)
    assert (out["entries_unused_deleted"], out["entries_kept"]) == (2, 2)
    assert (out["usage_files_read"], out["usage_files_written"]) == (1, 1)
    # Bounded: one listing of the usage files and one of the entries, a GET per usage file, a
    # DELETE per object on disk (2 entries, the folded usage file), one PUT for the fold.
    assert out["requests"] == {"LIST": 2, "GET": 1, "DELETE": 3, "PUT": 1}
    after = ResponseCache(url, "engine")
    assert set(after.lookup_many(keys)) == set(keys[:2])  # the unused ones are misses now
    assert (after.stats.corrupt, after.stats.read_errors) == (0, 0)
    # The fold keeps their use: a second gc a day later still keeps them, and reads the fold.
    again = rcgc.gc_responses(rcgc.open_layout(url), unused_s=DAY, now=time.time() + DAY / 2)
    assert (again["entries_unused_deleted"], again["entries_kept"], again["usage_files_read"]) == (0, 2, 1)
    # ... and once unused for longer than that, they go too.
    later = rcgc.gc_responses(rcgc.open_layout(url), unused_s=DAY, now=time.time() + 2 * DAY)
    assert (later["entries_unused_deleted"], later["entries_kept"], later["usage_files_written"]) == (2, 0, 0)


def test_max_size_evicts_the_least_recently_used_first(tmp_path):
    url, keys = str(tmp_path / "cache"), _keys(3)
    _fill(url, keys)
    _age(tmp_path / "cache", 5)
    reader = ResponseCache(url, "engine")
    reader.lookup_many([keys[0]])
    reader.record_usage(now=time.time() - 1 * DAY)
    reader.lookup_many([keys[2]])
    reader.record_usage(now=time.time() - 2 * DAY)
    size = max(p.stat().st_size for p in (tmp_path / "cache").rglob("v1/*/*.json"))
    out = rcgc.gc_responses(rcgc.open_layout(url), max_bytes=size)
    # keys[1] (last used 5 days ago) goes first, then keys[2] (2 days): keys[0] (1 day) stays.
    assert (out["entries_evicted_for_size"], out["entries_kept"]) == (2, 1)
    assert set(ResponseCache(url, "engine").lookup_many(keys)) == {keys[0]}


def test_usage_files_are_a_few_per_run_never_one_per_hit(tmp_path, monkeypatch):
    monkeypatch.setattr(rcgc, "USAGE_KEYS_PER_FILE", 2)
    url, keys = str(tmp_path / "cache"), _keys(5)
    _fill(url, keys)
    reader = ResponseCache(url, "engine")
    for key in keys:  # five separate lookups: still one record at the end of the run
        reader.lookup_many([key])
    reader.close()
    assert reader.stats.usage_files == 3 and reader.to_json()["requests"] == {"GET": 5, "PUT": 3}
    files = sorted((tmp_path / "cache" / "responses" / "usage").glob("*.usage"))
    seen = {k for f in files for k in rcgc.decode_usage(f.read_bytes(), str(f))}
    assert seen == set(keys)
    # A read-only cache records nothing; a run that served nothing writes no usage file.
    ro = ResponseCache(url, "engine", write=False)
    ro.lookup_many(keys)
    ro.close()
    idle = ResponseCache(url, "engine")
    idle.lookup_many([_keys(6)[5]])
    idle.close()
    assert ro.stats.usage_files == idle.stats.usage_files == 0 and len(files) == 3
    # Recording is advisory: a store that refuses the usage file costs the record, never the run.
    broken = ResponseCache(url, "engine")
    broken.lookup_many(keys[:1])
    monkeypatch.setattr(broken.layout, "put_new", lambda path, data: (_ for _ in ()).throw(PermissionError(path)))
    broken.close()
    assert (broken.stats.usage_files, broken.stats.usage_errors) == (0, 1)


def test_what_gc_did_not_write_is_left_alone(tmp_path):
    url, keys = str(tmp_path / "cache"), _keys(2)
    _fill(url, keys)
    _age(tmp_path / "cache", 3)
    usage = tmp_path / "cache" / "responses" / "usage"
    usage.mkdir(parents=True)
    (usage / "notes.json").write_text("{}")  # a name kvbatch never makes
    bad = usage / f"{int(time.time() * 1000):013d}-{'0' * 32}.usage"
    bad.write_text(json.dumps({"format": rcgc.USAGE_FORMAT, "version": 1, "keys": {"../x": 1.0}}))
    stray = tmp_path / "cache" / "responses" / "v1" / keys[0][:2] / "README.txt"
    stray.write_text("mine")
    # An answer kept under its family key (for shorter max_tokens) is an entry like the others.
    family = Path(rcgc.family_path(str(tmp_path / "cache"), keys[1]))
    family.parent.mkdir(parents=True)
    family.write_bytes(next((tmp_path / "cache").rglob("v1/*/*.json")).read_bytes())
    os.utime(family, (time.time() - 3 * DAY, time.time() - 3 * DAY))
    out = rcgc.gc_responses(rcgc.open_layout(url), unused_s=DAY)
    assert (out["entries_unused_deleted"], out["invalid_usage_files"], out["unknown_names"]) == (3, 2, 1)
    assert not family.exists()
    assert bad.exists() and (usage / "notes.json").exists() and stray.exists()
    with pytest.raises(rcgc.UsageInvalid, match="is not a response-cache key"):
        rcgc.decode_usage(bad.read_bytes(), str(bad))
    # A create-only write's temp file: removed once older than the grace (its writer died), never before
    # (a writer links it into place a moment later).
    old_tmp, young_tmp = (stray.parent / f".tmp-{c * 32}" for c in "ab")
    for p in (old_tmp, young_tmp):
        p.write_text("{")
    os.utime(old_tmp, (time.time() - 7200, time.time() - 7200))
    assert rcgc.gc_responses(rcgc.open_layout(url), unused_s=DAY)["temp_files_deleted"] == 1
    assert young_tmp.exists() and not old_tmp.exists()
    with pytest.raises(ValueError, match="needs unused_s and/or max_bytes"):
        rcgc.gc_responses(rcgc.open_layout(url))


def test_gc_racing_a_reader_gives_misses_never_errors(tmp_path):
    """A reader looking up and rewriting entries while gc deletes every one of them (max size 0):
    each lookup finds a whole, valid entry or nothing; nothing raises, nothing reads as corrupt."""
    url, keys = str(tmp_path / "cache"), _keys(16)
    _fill(url, keys)
    errors: list[BaseException] = []
    stop = threading.Event()
    deleted = [0]

    def collect() -> None:
        try:
            while not stop.is_set():
                deleted[0] += rcgc.gc_responses(rcgc.open_layout(url), max_bytes=0)["entries_evicted_for_size"]
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    gc = threading.Thread(target=collect)
    gc.start()
    reader = ResponseCache(url, "engine")
    found = missed = 0
    try:
        for _ in range(40):
            got = reader.lookup_many(keys)
            for key, body in got.items():
                assert body["text"] == f"answer {keys.index(key)}"
            found += len(got)
            missed += len(keys) - len(got)
            for key in set(keys) - set(got):  # a miss is recomputed and written again
                reader.put(key, _result(keys.index(key)))
            reader.flush()
    finally:
        stop.set()
        gc.join()
    assert errors == []
    assert (reader.stats.corrupt, reader.stats.read_errors, reader.stats.write_errors) == (0, 0, 0)
    assert deleted[0] > 0 and missed > 0  # the race happened: gc deleted what the reader then missed


def test_nights_and_the_cli_gc_keep_what_a_later_night_used(tmp_path, capsys):
    """Nights of the decode loop with a response cache (what ``kvbatch generate --response-cache``
    runs) and ``kvbatch response-cache gc``: the rows a later night served survive a gc, the others
    go, and the next night misses only those."""
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.io.batch_requests import read_requests
    from kvbatch.ops.decode.generate import run_jobs
    from kvbatch.ops.engine_build import build_llm
    from kvbatch.ops.jobs import tokenize_requests
    from tests.tiny_models import build_tiny_chat_model

    llm = build_llm(EngineSpec(model=str(build_tiny_chat_model(tmp_path / "tiny", max_positions=96)),
                               deterministic=True))
    cache = tmp_path / "cache"

    def night(name: str, n: int) -> dict:
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                           "body": {"messages": [{"role": "user", "content": f"Row {i}"}],
                                                    "max_tokens": 3, "temperature": 0}}) + "\n" for i in range(n)))
        rc = ResponseCache.for_llm(str(cache), llm, truncate=False)  # entries only (no family copies)
        report = run_jobs(llm, tokenize_requests(llm, read_requests(str(src))), str(tmp_path / f"{name}.out"),
                          response_cache=rc)
        rc.close()
        return {**report.to_json()["response_cache"], **rc.to_json()}

    assert night("first", 4)["writes"] == 4
    _age(cache, 3)
    second = night("second", 2)
    assert (second["hits"], second["usage_files"], second["requests"]) == (2, 1, {"GET": 2, "PUT": 1})
    capsys.readouterr()
    assert main(["response-cache", "gc", "--cache", str(cache), "--unused-days", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["entries_unused_deleted"], out["entries_kept"]) == (2, 2)
    third = night("third", 4)
    assert (third["hits"], third["misses"], third["corrupt"], third["read_errors"]) == (2, 2, 0, 0)
    assert main(["response-cache", "gc", "--cache", str(cache)]) == 2
    assert "needs --unused-days and/or --max-gb" in capsys.readouterr().err
    assert main(["response-cache", "gc", "--cache", str(cache), "--max-gb", "-1"]) == 2
    assert "--max-gb must be >= 0, got -1.0" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")  # a store that cannot be read: one line, status 2
    assert main(["response-cache", "gc", "--cache", str(tmp_path / "a_file" / "cache"), "--unused-days", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbatch: error: response-cache gc at ") and err.count("\n") == 1


def test_gc_on_s3_is_bounded_in_real_requests(s3, s3_endpoint, s3_fault_proxy, monkeypatch):
    """On a real S3 endpoint (moto behind the loopback proxy, which counts every HTTP request):
    the entries a later run used survive, the rest go; gc makes exactly the requests it reports
    (two listings, a GET per usage file, one DeleteObjects for the entries and one for the usage
    files, a PUT for the fold); a reader then misses the deleted ones without an error."""
    import s3fs

    _, opts, fs = s3
    endpoint, proxy = s3_fault_proxy
    bucket = s3[0].removeprefix("s3://").split("/", 1)[0]
    via_proxy = {**opts, "endpoint_url": endpoint}
    url, keys = f"s3://{bucket}/responses", _keys(5)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        _fill(url, keys, **via_proxy)
        t0 = time.time()
        reader = ResponseCache(url, "engine", storage_options=via_proxy)
        assert set(reader.lookup_many(keys[:2])) == set(keys[:2])
        reader.record_usage(now=t0 + 3 * DAY)  # the later run, three days on
        layout = rcgc.open_layout(url, via_proxy)
        before = proxy.counts["forwarded"]
        out = rcgc.gc_responses(layout, unused_s=DAY, now=t0 + 3 * DAY + 3600)
        real = proxy.counts["forwarded"] - before
        assert (out["entries_unused_deleted"], out["entries_kept"], out["usage_files_read"]) == (3, 2, 1)
        assert out["requests"] == {"LIST": 2, "GET": 1, "DELETE": 2, "PUT": 1}
        assert real == sum(out["requests"].values())
        left = sorted(p.rsplit("/", 1)[-1][:-5] for p in fs.find(f"{bucket}/responses/responses/v1"))
        assert left == sorted(keys[:2])
        after = ResponseCache(url, "engine", storage_options=via_proxy)
        assert set(after.lookup_many(keys)) == set(keys[:2])
        assert (after.stats.corrupt, after.stats.read_errors) == (0, 0)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
