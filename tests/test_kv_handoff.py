"""Prefill once, decode anywhere: decoding from stored KV gives exactly the tokens of an
in-process generate, whether the blocks come from memory, disk, a loopback S3 or partly each,
and every storage fault ends in correct tokens (the block is recomputed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM
from kvbatch.engine.spec import EngineSpec
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
from kvbatch.ops.decode.generate import run_batch, run_decode
from kvbatch.ops.prefill.manifests import ManifestMismatch
from kvbatch.ops.prefill.prefill import run_prefill
from tests.tiny_models import build_tiny_chat_model

SYSTEM = ("You are a meticulous assistant for a hardware store. Answer briefly, cite the aisle number, "
          "and never invent prices. ") * 3


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), max_positions=512)


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory) -> Path:
    rows = []
    for i, q in enumerate(["Where are the hammers?", "Do you sell rope?", "What about paint rollers?",
                           "Is there a key cutting service?", "Where can I find 3 mm screws?"]):
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                "max_tokens": 8, "temperature": 0}
        if i == 3:
            body.update(temperature=0.8, seed=11)
        rows.append(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}))
    rows.insert(2, '{"custom_id": "bad", "body": {"messages": []}}')
    rows.append(json.dumps({"custom_id": "short", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4, "temperature": 0}))  # plain chat row, shorter than a block
    path = tmp_path_factory.mktemp("data") / "requests.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def _llm(folder, store=None, **cfg) -> LLM:
    ckpt = load_checkpoint(str(folder))
    return LLM(ckpt, engine_config=EngineConfig(batch_invariant=True, max_num_seqs=8, **cfg), kv_store=store)


def _store(folder, url, **kw) -> KVStore:
    ckpt = load_checkpoint(str(folder))
    fp = EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(ckpt.fingerprint)
    return KVStore.from_config(KVStoreConfig(url=url, **{"memory_bytes": 0, **kw}), fp)


def _outputs(path: Path) -> list[tuple]:
    out = []
    for line in path.read_text().splitlines():
        o = json.loads(line)
        if o["error"]:
            out.append((o["custom_id"], "error", o["error"]["field"]))
        else:
            c = o["response"]["body"]["choices"][0]
            out.append((o["custom_id"], c["message"]["content"], c["finish_reason"],
                        o["response"]["body"]["usage"]["completion_tokens"]))
    return out


@pytest.fixture(scope="module")
def reference(tiny_chat, requests_file, tmp_path_factory) -> list[tuple]:
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    run_batch(_llm(tiny_chat), str(requests_file), str(out))
    return _outputs(out)


def _prefill_then_decode(tiny_chat, requests_file, tmp_path, url, **store_kw):
    manifests = tmp_path / "manifests.jsonl"
    pre = run_prefill(_llm(tiny_chat, _store(tiny_chat, url, **store_kw)), str(requests_file), str(manifests))
    out = tmp_path / "out.jsonl"
    decoder = _llm(tiny_chat, _store(tiny_chat, url, **store_kw))  # a fresh engine and store, as another worker
    report = run_decode(decoder, str(manifests), str(out))
    return pre, report, decoder, _outputs(out)


def test_decode_from_store_equals_in_process_generate(tiny_chat, requests_file, tmp_path, reference):
    pre, report, decoder, outputs = _prefill_then_decode(tiny_chat, requests_file, tmp_path,
                                                         (tmp_path / "kv").as_uri())
    assert outputs == reference
    assert pre.prompt_tokens_computed > 0 and pre.connector["blocks_written"] > 0
    assert pre.rejected == 1
    # One shard, one segment: its object and its index file are the prefill's only PUTs (issue 14),
    # and every request kind is reported, for the cost metrics to price.
    assert len(list((tmp_path / "kv" / "objects").rglob("*.arrow"))) == 1
    assert pre.connector["object_requests"]["PUT"] == 2
    assert set(pre.connector["object_requests"]) == {"GET", "PUT", "LIST", "HEAD", "DELETE"}
    # the segment's bytes: the blocks' raw bytes plus their Arrow framing
    assert pre.connector["kv_bytes_written_by_tier"]["object"] >= pre.connector["kv_bytes_written"] > 0
    dconn = decoder.connector.stats.to_json()
    # At most two ranged GETs per prompt: the shared system prompt (stored once, by the first prompt
    # that had it) and the prompt's own tail. Each stored block is loaded at most once: a prompt
    # waits for the shared blocks another is loading, then finds them in the cache. (How many are
    # loaded rather than recomputed follows the connector's measured costs: a lone tail block of a
    # tiny model may be cheaper to recompute, so the count is a bound, not a number.)
    distinct = {k for line in map(json.loads, (tmp_path / "manifests.jsonl").read_text().splitlines())
                for k in line.get("block_keys", ())}
    assert 0 < dconn["object_requests"]["GET"] <= 2 * 5 and dconn["object_requests"]["GET"] <= dconn["blocks_loaded"]
    assert 0 < dconn["blocks_loaded"] <= len(distinct), dconn
    # Its one PUT is the usage file saying which segments it read (retention by last use).
    assert dconn["object_requests"]["PUT"] == 1 and len(list((tmp_path / "kv" / "usage").rglob("*.json"))) == 1
    assert dconn["kv_bytes_written_by_tier"] == {"object": 0}
    # Decode loaded the shared system prompt instead of computing it.
    assert report.loaded_prompt_tokens == 16 * dconn["blocks_loaded"]
    assert report.loaded_prompt_tokens + report.cached_prompt_tokens >= 4 * 16 * (len(SYSTEM) // 100)
    assert decoder.stats["computed_prompt_tokens"] < report.prompt_tokens - report.loaded_prompt_tokens + 16 * 6
    # A second prefill over the same data computes nothing: every block is already stored.
    again = run_prefill(_llm(tiny_chat, _store(tiny_chat, (tmp_path / "kv").as_uri())), str(requests_file),
                        str(tmp_path / "m2.jsonl"))
    assert again.prompt_tokens_computed == 0
    assert again.prompt_tokens_already_stored > 0


def test_partial_prefix_hit_computes_only_the_rest(tiny_chat, requests_file, tmp_path, reference):
    url = (tmp_path / "kv").as_uri()
    # Store only the first request's blocks: the others share its system prompt and hit partially.
    first = tmp_path / "first.jsonl"
    first.write_text(requests_file.read_text().splitlines()[0] + "\n")
    run_prefill(_llm(tiny_chat, _store(tiny_chat, url)), str(first), str(tmp_path / "m1.jsonl"))
    pre, report, _, outputs = _prefill_then_decode(tiny_chat, requests_file, tmp_path, url)
    assert outputs == reference
    assert pre.connector["blocks_loaded"] > 0  # the partial hits were loaded, not recomputed


def test_disk_and_memory_tiers_serve_the_same_tokens(tiny_chat, requests_file, tmp_path, reference):
    url = (tmp_path / "kv").as_uri()
    manifests = tmp_path / "manifests.jsonl"
    run_prefill(_llm(tiny_chat, _store(tiny_chat, url)), str(requests_file), str(manifests))
    store = _store(tiny_chat, url, memory_bytes=1 << 30, disk_dir=str(tmp_path / "disk"))
    decoder = _llm(tiny_chat, store)
    out1, out2 = tmp_path / "o1.jsonl", tmp_path / "o2.jsonl"
    run_decode(decoder, str(manifests), str(out1))  # object store -> promoted into disk and memory
    decoder2 = _llm(tiny_chat, store)  # a new engine (empty paged cache), same process-level store
    run_decode(decoder2, str(manifests), str(out2))
    # A third worker with only the disk folder (no memory tier) left by the first two.
    decoder3 = _llm(tiny_chat, _store(tiny_chat, url, disk_dir=str(tmp_path / "disk")))
    out3 = tmp_path / "o3.jsonl"
    run_decode(decoder3, str(manifests), str(out3))
    assert _outputs(out1) == reference and _outputs(out2) == reference and _outputs(out3) == reference
    tiers1 = decoder.connector.stats.tokens_loaded_by_tier
    tiers2 = decoder2.connector.stats.tokens_loaded_by_tier
    tiers3 = decoder3.connector.stats.tokens_loaded_by_tier
    assert tiers1["object"] > 0 and set(tiers2) == {"memory"} and set(tiers3) == {"disk"}, (tiers1, tiers2, tiers3)


def test_s3_roundtrip_and_faults(tiny_chat, requests_file, tmp_path, reference, s3):
    url, opts, fs = s3
    pre, report, decoder, outputs = _prefill_then_decode(tiny_chat, requests_file, tmp_path, url,
                                                         storage_options=opts)
    assert outputs == reference and report.loaded_prompt_tokens > 0
    packs = sorted(p for p in fs.find(url.removeprefix("s3://")) if p.endswith(".arrow"))
    assert packs
    # Corrupt one pack, truncate another (or the same when there is one), delete nothing yet.
    data = fs.cat_file(packs[0])
    mid = len(data) // 2  # inside some block's data (one segment may hold them all)
    fs.pipe_file(packs[0], data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:])
    out = tmp_path / "corrupt.jsonl"
    bad = _llm(tiny_chat, _store(tiny_chat, url, storage_options=opts))
    run_decode(bad, str(tmp_path / "manifests.jsonl"), str(out))
    assert _outputs(out) == reference
    last = fs.cat_file(packs[-1])
    fs.pipe_file(packs[-1], last[: len(last) * 3 // 4])
    for p in packs[1:-1]:
        fs.rm(p)
    out = tmp_path / "faults.jsonl"
    bad = _llm(tiny_chat, _store(tiny_chat, url, storage_options=opts))
    run_decode(bad, str(tmp_path / "manifests.jsonl"), str(out))
    assert _outputs(out) == reference
    assert sum(bad.connector.stats.misses_by_reason.values()) > 0


def test_manifests_from_another_model_are_refused(tiny_chat, requests_file, tmp_path, tmp_path_factory):
    url = (tmp_path / "kv").as_uri()
    manifests = tmp_path / "manifests.jsonl"
    run_prefill(_llm(tiny_chat, _store(tiny_chat, url)), str(requests_file), str(manifests))
    other = build_tiny_chat_model(tmp_path_factory.mktemp("other"), seed=1, max_positions=512)
    with pytest.raises(ManifestMismatch, match="fingerprint"):
        run_decode(_llm(other, _store(other, url)), str(manifests), str(tmp_path / "o.jsonl"))


def test_cli_prefill_decode_and_kv_commands(tiny_chat, requests_file, tmp_path, reference, capsys):
    from kvbatch.cli.main import main

    store = (tmp_path / "kv").as_uri()
    manifests, out = tmp_path / "m.jsonl", tmp_path / "o.jsonl"
    pre_metrics, dec_metrics = tmp_path / "pre.json", tmp_path / "dec.json"
    common = ["--model", str(tiny_chat), "--store", store, "--deterministic", "--max-batch", "8", "--no-progress"]
    assert main(["prefill", *common, "--input", str(requests_file), "--manifests", str(manifests),
                 "--metrics", str(pre_metrics)]) == 1  # one row is rejected
    assert main(["decode", *common, "--manifests", str(manifests), "--output", str(out),
                 "--metrics", str(dec_metrics)]) == 1
    assert _outputs(out) == reference
    pre, dec = json.loads(pre_metrics.read_text()), json.loads(dec_metrics.read_text())
    assert pre["blocks_written"] > 0 and pre["prompt_tokens_computed"] > 0
    assert dec["loaded_prompt_tokens"] > 0 and dec["kv_store"]["blocks_loaded"] > 0
    capsys.readouterr()
    assert main(["kv", "stats", "--store", store]) == 0
    assert "blocks" in capsys.readouterr().out
    assert main(["kv", "gc", "--store", store, "--ttl-hours", "0.000001"]) == 0
    capsys.readouterr()
    # Everything expired: decode still answers every row, recomputing the prompts.
    again, again_metrics = tmp_path / "o2.jsonl", tmp_path / "dec2.json"
    assert main(["decode", *common, "--manifests", str(manifests), "--output", str(again),
                 "--metrics", str(again_metrics)]) == 1
    assert _outputs(again) == reference
    assert json.loads(again_metrics.read_text())["loaded_prompt_tokens"] == 0
    assert main(["kv", "gc", "--store", store]) == 2  # needs a policy


def test_decode_reads_where_the_manifests_say_with_no_index_request(tiny_chat, requests_file, tmp_path, reference):
    url = (tmp_path / "kv").as_uri()
    manifests = tmp_path / "manifests.jsonl"
    run_prefill(_llm(tiny_chat, _store(tiny_chat, url)), str(requests_file), str(manifests))
    lines = [json.loads(t) for t in manifests.read_text().splitlines()]
    jobs = [m for m in lines if "block_keys" in m]
    assert all(m["v"] == 2 for m in lines) and any(m["block_keys"] for m in jobs)
    segments = {p.stem for p in (tmp_path / "kv" / "objects").rglob("*.arrow")}
    for m in jobs:  # every block's location, in a published segment, for the key at its position
        assert [loc["key"] for loc in m["block_locations"]] == m["block_keys"]
        assert all(loc["segment"].split("/")[1] in segments for loc in m["block_locations"])
    decoder = _llm(tiny_chat, _store(tiny_chat, url))
    out = tmp_path / "out.jsonl"
    run_decode(decoder, str(manifests), str(out))
    assert _outputs(out) == reference
    req = decoder.connector.stats.to_json()["object_requests"]
    # The layout marker, then ranged reads of the blocks only: no listing, no index file read.
    assert req["LIST"] == 0 and 1 < req["GET"] <= 1 + 2 * 5, req

    # Manifests of version 1 (no locations) still decode: the blocks are found through the index.
    old = tmp_path / "v1.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in dict(m, v=1).items() if k != "block_locations"}) + "\n"
                           for m in lines))
    v1 = _llm(tiny_chat, _store(tiny_chat, url))
    run_decode(v1, str(old), str(tmp_path / "v1-out.jsonl"))
    assert _outputs(tmp_path / "v1-out.jsonl") == reference
    assert v1.connector.stats.to_json()["object_requests"]["LIST"] > 0
    # (each loads what its connector's measured costs favour: at most every stored block, once)
    assert 0 < v1.connector.stats.blocks_loaded <= len({k for m in jobs for k in m["block_keys"]})
    assert 0 < decoder.connector.stats.blocks_loaded


def test_a_tampered_block_location_is_a_rejected_row_or_a_recomputed_block(tiny_chat, requests_file, tmp_path,
                                                                          reference):
    url = (tmp_path / "kv").as_uri()
    manifests = tmp_path / "manifests.jsonl"
    run_prefill(_llm(tiny_chat, _store(tiny_chat, url)), str(requests_file), str(manifests))
    lines = [json.loads(t) for t in manifests.read_text().splitlines()]
    first = next(i for i, m in enumerate(lines) if m.get("block_locations"))
    lines[first]["block_locations"][0]["key"] = lines[first]["block_keys"][-1]  # another block's key
    shifted = next(i for i, m in enumerate(lines) if i > first and m.get("block_locations"))
    lines[shifted]["block_locations"][0]["offset"] -= 8  # a range that fails its checksum
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(m) + "\n" for m in lines))
    decoder = _llm(tiny_chat, _store(tiny_chat, url))
    out = tmp_path / "out.jsonl"
    run_decode(decoder, str(bad), str(out))
    got = _outputs(out)
    assert got[first][1:] == ("error", "manifest.block_locations.0.key")
    assert [g for i, g in enumerate(got) if i != first] == [r for i, r in enumerate(reference) if i != first]
    assert decoder.connector.stats.misses_by_reason["checksum"] >= 1
