"""A failing object store, for real: every fault comes from a loopback proxy in front of moto
(tests/s3_fault_proxy.py), so s3fs, botocore, the KV store's retries and its circuit breaker meet
503s, resets, stalls, truncated bodies and refused connections on a real socket.

What must hold: the right bytes or a counted miss (then the block is recomputed and the tokens are
those of a run without faults), bounded time, and the outage visible in the metrics, in one
warning line, and in the exit status of `kvbatch prefill` / `kvbatch kv ...`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from kvbatch.cli.main import main
from kvbatch.engine.spec import EngineSpec
from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
from kvbatch.io.shard_tables import shard_url
from kvbatch.io.urls import redact, redact_text
from kvbatch.ops.decode.generate import run_batch
from kvbatch.ops.ingest.prompts import ingest
from kvbatch.ops.decode.generate import run_decode
from kvbatch.ops.prefill.prefill import run_prefill
from kvbatch.ops.prefill.prefill import prefill_shard
from kvbatch.ops.decode.shard import decode_shard
from kvbatch.ops.shards.build import build_shards
from tests.tiny_models import build_tiny_chat_model

SYSTEM = "You answer for a hardware store: be brief, give the aisle, never invent a price. " * 3
PACKS = r"/objects/.*\.arrow"  # the requests that read or write KV packs
OUTAGE = "is unavailable"  # the breaker's one warning line
BACK = "answers again"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=256)


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory) -> Path:
    rows = []
    for i, q in enumerate(["Where are the hammers?", "Do you sell rope?", "Paint rollers?"]):
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                "max_tokens": 3, "temperature": 0}
        if i == 2:
            body.update(temperature=0.8, seed=5)
        rows.append(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}))
    path = tmp_path_factory.mktemp("data") / "requests.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


_CHECKPOINTS: dict[str, object] = {}


def _checkpoint(tiny: Path):
    if str(tiny) not in _CHECKPOINTS:  # each LLM copies what it needs: one read serves them all
        _CHECKPOINTS[str(tiny)] = load_checkpoint(str(tiny))
    return _CHECKPOINTS[str(tiny)]


def _llm(tiny: Path, store: KVStore | None = None) -> LLM:
    return LLM(_checkpoint(tiny), engine_config=EngineConfig(batch_invariant=True, max_num_seqs=4), kv_store=store)


def _outputs(path: Path) -> list[tuple]:
    out = []
    for line in path.read_text().splitlines():
        o = json.loads(line)
        c = o["response"]["body"]["choices"][0]
        out.append((o["custom_id"], c["message"]["content"], c["finish_reason"]))
    return out


@pytest.fixture(scope="module")
def reference(tiny, requests_file, tmp_path_factory) -> list[tuple]:
    """The tokens of an in-process run with no store at all."""
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    run_batch(_llm(tiny), str(requests_file), str(out))
    return _outputs(out)


@pytest.fixture(autouse=True)
def _fresh_s3_clients():
    # fsspec caches filesystems by their options, not by the environment: a client made for an
    # earlier test's endpoint (AWS_ENDPOINT_URL) must not serve the next one.
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


# Small timeouts and a short breaker, set through the config: faults cost fractions of a second.
FAST = {"connect_timeout_s": 1.0, "read_timeout_s": 0.5, "retry_attempts": 3, "retry_budget_s": 3.0,
        "breaker_failures": 3, "breaker_cooldown_s": 60.0,
        # one block per segment, each written as it comes: these tests count requests per block
        "pack_bytes": 1}


def _kv(url: str, endpoint: str, fingerprint: str = "fp-test", **kw) -> KVStore:
    opts = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
    cfg = KVStoreConfig(url=url, memory_bytes=0, storage_options=opts, **{**FAST, **kw})
    return KVStore.from_config(cfg, fingerprint)


def _model_kv(tiny: Path, url: str, endpoint: str, **kw) -> KVStore:
    return _kv(url, endpoint, EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(_checkpoint(tiny).fingerprint), **kw)


def _blocks(n: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"{seed:08x}{i:024x}", torch.randn(2, 2, 4, 2, 8, generator=g)) for i in range(n)]


def _same(got, blocks) -> bool:
    return all(t is not None and torch.equal(t, b) for (t, _), (_, b) in zip(got, blocks, strict=True))


def _object(store: KVStore) -> dict:
    return store.stats()["tiers"]["object"]


def _lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


# ----------------------------------------------------------------------------- the store alone


def test_503s_are_retried_counted_and_the_bytes_are_right(s3, s3_fault_proxy):
    url, _, _ = s3
    endpoint, proxy = s3_fault_proxy
    blocks = _blocks(4)
    proxy.plan("503", method="PUT", times=2)
    writer = _kv(url, endpoint)
    assert writer.put_many(blocks) == 4
    proxy.plan("503", method="GET", path=PACKS, times=2)
    reader = _kv(url, endpoint)
    got = reader.get_many([k for k, _ in blocks])
    assert _same(got, blocks)
    assert proxy.counts["503"] == 4
    w, r = _object(writer), _object(reader)
    assert w["retries"] >= 2 and r["retries"] >= 2, (w, r)
    assert w["failures"] == r["failures"] == 0 and w["breaker_opens"] == r["breaker_opens"] == 0
    assert r["fault_wait_s"] > 0 and writer.stats()["puts_failed"] == 0


def test_resets_are_retried_and_cut_bodies_are_misses(s3, s3_fault_proxy):
    url, _, _ = s3
    endpoint, proxy = s3_fault_proxy
    blocks = _blocks(3, seed=1)
    keys = [k for k, _ in blocks]
    _kv(url, endpoint).put_many(blocks)
    reader = _kv(url, endpoint, breaker_failures=10)

    proxy.plan("reset", method="GET", path=PACKS, times=4)  # more than aiohttp's own one silent retry
    assert _same(reader.get_many(keys), blocks)
    assert proxy.counts["reset"] == 4 and _object(reader)["retries"] >= 1

    # Full Content-Length, half the body: the transport notices, retries, then gives up: a miss.
    proxy.clear()
    proxy.plan("truncate", method="GET", path=PACKS)
    assert [r for _, r in reader.get_many(keys)] == ["io_error"] * 3
    assert _object(reader)["failures"] >= 3

    # Half the body with a matching Content-Length: only the block's own length/checksum can tell.
    proxy.clear()
    proxy.plan("short", method="GET", path=PACKS)
    assert [r for _, r in reader.get_many(keys)] == ["truncated"] * 3
    assert proxy.counts["truncate"] > 0 and proxy.counts["short"] == 3
    assert _object(reader)["misses_by_reason"] == {"io_error": 3, "truncated": 3}


def test_a_stall_longer_than_the_read_timeout_costs_bounded_time(s3, s3_fault_proxy, caplog):
    url, _, _ = s3
    endpoint, proxy = s3_fault_proxy
    blocks = _blocks(3, seed=2)
    _kv(url, endpoint).put_many(blocks)
    reader = _kv(url, endpoint, read_timeout_s=0.3, retry_attempts=2, breaker_failures=2)
    proxy.plan("stall", method="GET", path=PACKS, stall_s=20.0)  # unbounded reads would wait 20 s each
    got = reader.get_many([k for k, _ in blocks])
    assert {r for _, r in got} <= {"io_error", "tier_unavailable"} and got[-1] == (None, "tier_unavailable")
    o = _object(reader)
    assert o["timeouts"] >= 2 and o["breaker_opens"] == 1 and o["calls_skipped_open"] >= 1, o
    # Bounded time, by counts rather than a clock: every stalled read ended by the client's read
    # timeout (none waited for the stall to end), and no more reads were stalled than the merged
    # read of the blocks and two calls' attempts (the breaker opened after two give-ups).
    assert o["timeouts"] >= proxy.counts["stall"] >= 2, (o, proxy.counts)
    assert proxy.counts["stall"] <= len(blocks) + 2 * 2, (o, proxy.counts)  # the merged read, then 2 x 2 attempts
    assert len(_lines(caplog, OUTAGE)) == 1


def test_the_breaker_opens_once_probes_after_its_cool_down_and_closes(s3, s3_fault_proxy, caplog):
    url, _, _ = s3
    endpoint, proxy = s3_fault_proxy
    blocks = _blocks(2, seed=3)
    _kv(url, endpoint).put_many(blocks)
    proxy.refuse()
    # One give-up opens it; a cool-down of 0 makes the next call the probe (no waiting in a test).
    store = _kv(url, endpoint, breaker_failures=1, breaker_cooldown_s=0.0)
    assert store.durable.breaker.state == "half_open"  # opened by the first index listing
    (line,) = _lines(caplog, OUTAGE)
    assert "tier_unavailable" in line and f"endpoint {endpoint}" in line
    proxy.resume()
    assert _same(store.get_many([k for k, _ in blocks]), blocks)
    assert store.durable.breaker.state == "closed" and len(_lines(caplog, BACK)) == 1
    assert _object(store)["breaker_opens"] == 1


# ----------------------------------------------------------------------------- with the engine


def test_refused_store_one_warning_fast_run_correct_tokens(tiny, requests_file, reference, s3, s3_fault_proxy,
                                                           tmp_path, caplog):
    url, _, _ = s3
    endpoint, proxy = s3_fault_proxy
    manifests = tmp_path / "manifests.jsonl"
    pre = run_prefill(_llm(tiny, _model_kv(tiny, url, endpoint)), str(requests_file), str(manifests))
    assert pre.connector["blocks_written"] > 0
    proxy.refuse()
    caplog.clear()
    decoder = _llm(tiny, _model_kv(tiny, url, endpoint))
    out = tmp_path / "out.jsonl"
    report = run_decode(decoder, str(manifests), str(out))
    assert _outputs(out) == reference
    assert report.loaded_prompt_tokens == 0
    o = _object(decoder.connector.store)
    assert o["breaker_opens"] == 1 and o["calls_skipped_open"] > 0 and o["failures"] == 3, o
    # Fast, by counts: three calls gave up after at most their attempts each (a merged read also
    # retries each of its block ranges once, on its own), every attempt was refused at once (no
    # timeout waited out), and every later call was skipped by the open breaker.
    blocks = pre.connector["blocks_written"]
    assert o["retries"] <= o["failures"] * (FAST["retry_attempts"] - 1) + blocks and o["timeouts"] == 0, o
    # No block could be looked up (the index listings failed, then the breaker opened): misses.
    lookups = decoder.connector.stats.misses_by_reason
    assert lookups and set(lookups) <= {"io_error", "tier_unavailable"}, lookups
    assert len(_lines(caplog, OUTAGE)) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and OUTAGE not in r.getMessage()]


def test_lookups_skipped_by_an_open_breaker_are_misses_in_generate_metrics(tiny, s3, s3_fault_proxy, tmp_path,
                                                                          aws_env):
    url, _, _ = s3
    endpoint, proxy = s3_fault_proxy
    aws_env.setenv("AWS_ENDPOINT_URL", endpoint)
    # Prompts that share no block, so each is looked up in the store (none waits for another's
    # prefix): the first lookups fail and open the breaker, the later ones are skipped.
    n = 6
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"d{i}", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"messages": [
        {"role": "system", "content": f"{i} {SYSTEM}"}, {"role": "user", "content": "Hammers?"}],
        "max_tokens": 1, "temperature": 0}}) + "\n" for i in range(n)))
    proxy.refuse()
    metrics = tmp_path / "m.json"
    assert main(["generate", "--model", str(tiny), "--input", str(src), "--output", str(tmp_path / "out.jsonl"),
                 "--store", url, "--store-memory-gb", "0", "--metrics", str(metrics), "--no-progress"]) == 0
    kv = json.loads(metrics.read_text())["kv_store"]
    o = kv["store"]["tiers"]["object"]
    assert o["breaker_opens"] == 1 and o["calls_skipped_open"] > 0, o
    skipped = kv["misses_by_reason"].get("tier_unavailable", 0)  # the connector's: what generate looked up
    assert skipped > 0 and set(kv["misses_by_reason"]) <= {"io_error", "tier_unavailable"}, kv["misses_by_reason"]
    assert kv["store"]["misses_by_reason"]["tier_unavailable"] == o["misses_by_reason"]["tier_unavailable"] == skipped
    assert kv["blocks_loaded"] == 0


def test_cut_pack_reads_are_recomputed_to_the_same_tokens(tiny, requests_file, reference, s3, s3_fault_proxy,
                                                          tmp_path):
    url, _, _ = s3
    endpoint, proxy = s3_fault_proxy
    manifests = tmp_path / "manifests.jsonl"
    run_prefill(_llm(tiny, _model_kv(tiny, url, endpoint)), str(requests_file), str(manifests))

    proxy.plan("short", method="GET", path=PACKS)  # every pack read comes back cut
    cut = _llm(tiny, _model_kv(tiny, url, endpoint))
    run_decode(cut, str(manifests), str(tmp_path / "cut.jsonl"))
    assert _outputs(tmp_path / "cut.jsonl") == reference
    assert cut.connector.stats.misses_by_reason["truncated"] > 0 and cut.connector.stats.blocks_loaded == 0
    assert _object(cut.connector.store)["misses_by_reason"]["truncated"] > 0


# ----------------------------------------------------------------------------- the command line


@pytest.fixture
def aws_env(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return monkeypatch


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kvbatch: error:")]


def test_prefill_exits_2_when_the_store_took_none_or_only_some(tiny, requests_file, s3, s3_fault_proxy, tmp_path,
                                                               aws_env, capsys):
    url, _, _ = s3
    endpoint, proxy = s3_fault_proxy
    aws_env.setenv("AWS_ENDPOINT_URL", endpoint)
    common = ["prefill", "--model", str(tiny), "--store", url, "--input", str(requests_file), "--no-progress"]

    # The shard's one segment keeps failing (4 attempts): its blocks were accepted, then lost at
    # the flush; the counts say so (none written, all failed), not what put_many accepted.
    proxy.plan("503", method="PUT", path=PACKS, times=4)
    assert main([*common, "--manifests", str(tmp_path / "m1.jsonl"), "--metrics", str(tmp_path / "p1.json")]) == 2
    (line,) = _errors(capsys.readouterr().err)
    metrics = json.loads((tmp_path / "p1.json").read_text())
    failed, written = metrics["store"]["puts_failed"], metrics["blocks_written"]
    assert failed > 0 and written == 0 and metrics["kv_bytes_written"] == 0
    assert f"stored none of the {failed} blocks" in line and f"({failed} failed" in line
    assert metrics["object_requests"]["PUT"] >= 4  # the failed attempts are requests too

    proxy.clear()
    proxy.refuse()
    assert main([*common, "--manifests", str(tmp_path / "m2.jsonl"), "--metrics", str(tmp_path / "p2.json")]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert "stored none of the" in line
    p2 = json.loads((tmp_path / "p2.json").read_text())
    o = p2["store"]["tiers"]["object"]
    assert o["breaker_opens"] == 1 and o["blocks_failed"] > 0 and o["calls_skipped_open"] > 0, o
    assert p2["store"]["misses_by_reason"]["tier_unavailable"] > 0, p2["store"]  # the lookups it skipped
    # Bounded, by counts: the calls that reached the store gave up within their attempts (refused
    # at once: no timeout waited out); everything after the breaker opened was skipped.
    assert o["retries"] <= o["failures"] * 3 and o["timeouts"] == 0, o
    assert (tmp_path / "m2.jsonl").read_text().count("\n") == 3  # the manifests are still whole


@pytest.mark.timeout(120)  # bounded retries answer in seconds; a command that kept retrying would not
def test_kv_commands_on_an_unreachable_store_say_one_line_without_credentials(s3_fault_proxy, aws_env, capsys):
    endpoint, proxy = s3_fault_proxy
    proxy.refuse()
    aws_env.setenv("AWS_ENDPOINT_URL", endpoint)
    # A hang would end at this test's timeout (the mark above), not at a clock the test reads.
    assert main(["kv", "stats", "--store", "s3://bucket/kv"]) == 2
    assert main(["kv", "gc", "--store", "s3://bucket/kv", "--ttl-hours", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 2 and len(_errors(err)) == 2, err
    assert all("s3://bucket/kv" in line for line in _errors(err))

    secret_url = "s3://AKIAFAKEKEY:sec/ret+Zz9@bucket/kv"
    assert main(["kv", "stats", "--store", secret_url]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "s3://***@bucket/kv" in err, err
    for piece in ("AKIAFAKEKEY", "sec/ret", "ret+Zz9"):
        assert piece not in err


@pytest.mark.parametrize("secret_url", ["s3://KEY:SECRET@bucket/x.jsonl",
                                        "s3://AKIAFAKEKEY:sec/ret+Zz9@bucket/x.jsonl"], ids=["key-secret", "slash"])
@pytest.mark.timeout(120)  # an input read retried without bound would end here, not in a timed assert
def test_an_s3_input_with_a_credential_fails_in_one_line_without_it(s3_fault_proxy, aws_env, capsys, tmp_path,
                                                                    secret_url):
    endpoint, proxy = s3_fault_proxy
    proxy.refuse()
    aws_env.setenv("AWS_ENDPOINT_URL", endpoint)
    model = str(tmp_path / "no-such-model")  # the input fails first, before any model is looked for
    for argv in (["generate", "--output", str(tmp_path / "out.jsonl")],
                 ["prefill", "--manifests", str(tmp_path / "m.jsonl"), "--store", str(tmp_path / "kv")]):
        assert main([*argv, "--model", model, "--input", secret_url, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and len(_errors(err)) == 1, err
        assert "cannot read s3://***@bucket/x.jsonl" in err and "no-such-model" not in err, err
        for piece in ("KEY:SECRET", "SECRET", "AKIAFAKEKEY", "sec/ret", "ret+Zz9"):
            assert piece not in err, err


def test_redact_masks_userinfo_and_secret_parameters():
    assert redact("s3://KEY:SECRET@bucket/kv") == "s3://***@bucket/kv"
    assert redact("https://user:pa/ss@host:9000/p?x=1") == "https://***@host:9000/p?x=1"
    assert redact("https://host/p?X-Amz-Signature=abc&part=2") == "https://host/p?X-Amz-Signature=***&part=2"
    assert redact("s3://bucket/a@b") == "s3://bucket/a@b" and redact("/data/kv") == "/data/kv"
    assert redact_text('bucket "KEY:SE" is invalid', "s3://KEY:SE/CRET@bucket") == 'bucket "***" is invalid'


# ----------------------------------------------------------------------------- the pipeline's steps


def test_shard_steps_through_503s_equal_a_clean_run(tiny, s3, s3_fault_proxy, tmp_path):
    url, _, _ = s3
    endpoint, proxy = s3_fault_proxy
    rows = [{"custom_id": f"id-{i}", "messages": [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": f"Something about {i}"}],
             "max_tokens": 3, "temperature": 0} for i in range(3)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    ingest(str(tmp_path / "in.jsonl"), prompts, str(tmp_path / "rejects.parquet"))
    root = str(tmp_path / "out")
    fp = EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(_checkpoint(tiny).fingerprint)
    # The clean run: one engine (sharding, prefill and decode) on a local store.
    local = _llm(tiny, KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0), fp))
    build_shards(local, prompts, root, 1, rejects_url=str(tmp_path / "sr.parquet"))
    shard = shard_url(root, "shards", "0000")

    def run(prefiller: LLM, decoder: Callable[[], LLM], tag: str) -> tuple[list[dict], dict, dict]:
        manifests, results = str(tmp_path / f"{tag}.jsonl"), str(tmp_path / f"{tag}.parquet")
        pre = prefill_shard(prefiller, shard, manifests)
        dec = decode_shard(decoder(), manifests, results)  # made after the prefill: its index sees the packs
        table = pq.read_table(results).select(["custom_id", "text", "output_token_ids", "finish_reason"])
        return table.to_pylist(), pre, dec

    clean, _, _ = run(local, lambda: local, "clean")
    proxy.plan("503", fraction=0.3, seed=11)  # any request: listings, index reads, pack writes and reads

    def faulty_llm() -> LLM:
        return _llm(tiny, _model_kv(tiny, url, endpoint, retry_attempts=6, breaker_failures=10))

    faulty, pre, dec = run(faulty_llm(), faulty_llm, "faulty")  # decode on a fresh engine: it loads
    assert faulty == clean
    assert proxy.counts["503"] > 0 and dec["loaded_prompt_tokens"] > 0
    assert pre["store"]["tiers"]["object"]["retries"] + dec["store"]["tiers"]["object"]["retries"] > 0
