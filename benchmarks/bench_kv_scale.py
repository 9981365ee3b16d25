"""The KV store at scale, on S3 (moto's server on loopback), layout 2 against the layout of before.

    python benchmarks/bench_kv_scale.py            # stores of 10^4 and 10^5 blocks (tens of minutes on 2 cores)
    python benchmarks/bench_kv_scale.py --quick    # stores of 10^3 and 10^4 blocks, a smoke run (~2 minutes)
    python benchmarks/bench_kv_scale.py --sizes 10000 100000 1000000 --json out.json

Synthetic blocks (1 KiB each, float16 [2, 2, 16, 1, 8]: the KV of 16 tokens of a one-layer,
one-head model); every prompt is a chain of `--blocks-per-prompt` blocks whose first
`--shared-blocks` are a system prompt shared by its group of `--group` prompts. Both layouts are
measured in the same run with the same code: "before" is layout 2's writer made to write one
pack and one index file per sequence (what `connector.save` did before issue 14: one
`put_many` per sequence per step, each written at once); "segments" buffers across sequences and
writes a segment per `--segment-mb`.

Measured, per layout:
1. prefill of 1,000 prompts: objects written and requests by kind (PUT/GET/LIST/HEAD), per
   1,000 prompts, and stored bytes per token;
2. decode start-up for a fixed shard of 1,000 prompts in stores of each `--sizes` blocks: the
   requests and seconds from opening the store to knowing where every block of the shard is.
   "before": a reader lists the index and reads every index file. "segments": decode is handed
   each block's location by the prefill manifests (`startup_*`: no index request at all); and a
   cross-run lookup of `--lookup-keys` (1,000) of its keys by a fresh reader through the
   partitioned index: requests, bytes and seconds, once through whole partitions
   (`lookup_whole_partitions`: the reader before paged partitions) and once through paged ones
   (`lookup_paged`: a directory entry and a page per key), each after a compaction
   (`kv compact`) run as the nightly gc would, more than its grace after the writes;
3. range-read throughput: the shard's blocks fetched, MB/s (one ranged GET per chain run with
   segments; one per block before);
4. two nights (segments only): night 1 (written as if ten days ago) stores `--shard` prompts;
   night 2's prompts share night 1's system prompts with tails of their own: the share of night
   2's system-prompt tokens the store serves, and whether `kv gc --unused-days 3` after night 2
   keeps every block night 2 used; night 1's segments, mostly one-off tails, are rewritten down
   to the used system prompts, and the gc of the next night (25 h later, past the grace) deletes
   the old ones: stored bytes before and after, and the share of the one-off blocks removed.

Prints the CPU (lscpu) next to the figures; the machine may be shared with other work.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch

from kvbatch.io.kvstore import object_layout, object_tier
from kvbatch.io.kvstore.compaction import compact_index
from kvbatch.io.kvstore.faults import RetryPolicy
from kvbatch.io.kvstore.object_tier import ObjectStoreTier
from kvbatch.io.kvstore.store import KVStore

FP = "bench-kv-scale|float16|bs16"
SHAPE = (2, 2, 16, 1, 8)
TOKENS_PER_BLOCK = 16
PAYLOAD = torch.zeros(SHAPE, dtype=torch.float16)  # content does not change what is measured


def block_key(prompt: int, i: int, group: int, shared: int, salt: str) -> str:
    owner = f"g{prompt // group}" if i < shared else f"p{prompt}"
    return hashlib.sha256(f"{salt}/{owner}/{i}".encode()).hexdigest()


def prompt_keys(prompt: int, args: argparse.Namespace, salt: str) -> list[str]:
    return [block_key(prompt, i, args.group, args.shared_blocks, salt) for i in range(args.blocks_per_prompt)]


def open_store(url: str, opts: dict[str, Any], args: argparse.Namespace) -> KVStore:
    tier = ObjectStoreTier(url, opts, pack_bytes=int(args.segment_mb * 2**20), index_refresh_s=3600.0,
                           retry=RetryPolicy(attempts=2, budget_s=5.0), flush_after_s=3600.0)
    return KVStore([tier], FP)


def prefill(store: KVStore, prompts: range, args: argparse.Namespace, salt: str, layout: str) -> dict[str, Any]:
    """Store every prompt's chain, one put_many per prompt, as the engine saves them."""
    before = store.request_counts()
    objects_before = store.durable.counters.bytes_written
    packs_before = len(store.durable._manifests)
    t0 = time.perf_counter()
    for p in prompts:
        store.put_many([(k, PAYLOAD) for k in prompt_keys(p, args, salt)])
        if layout == "before":
            store.flush()  # one pack + one index file per sequence, as before issue 14
    store.flush()
    wall = time.perf_counter() - t0
    req = store.durable.layout.requests.since(before)
    packs = len(store.durable._manifests) - packs_before
    nbytes = store.durable.counters.bytes_written - objects_before
    stored_blocks = store.durable.counters.blocks_written
    return {"prompts": len(prompts), "objects": 2 * packs, "requests": req, "wall_s": round(wall, 3),
            "bytes_per_token": round(nbytes / max(stored_blocks, 1) / TOKENS_PER_BLOCK, 1)}


def startup_and_read(url: str, opts: dict[str, Any], args: argparse.Namespace, salt: str,
                     layout: str, locations: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A fresh decode worker for the shard of the first 1,000 prompts: open, look up, fetch.

    With `locations` (what prefill's manifests carry) it is handed where each block is."""
    shard = [k for p in range(args.shard) for k in prompt_keys(p, args, salt)]
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    store = open_store(url, opts, args)
    if locations is not None:
        store.add_locations(locations)
    assert all(store.contains(shard))
    startup_s = time.perf_counter() - t0
    startup = dict(store.request_counts())
    before = store.request_counts()
    t1 = time.perf_counter()
    nbytes = 0
    with reads_as(layout):
        for p in range(args.shard):  # one get_many per prompt, as the engine loads a sequence
            for t, _ in store.get_many(prompt_keys(p, args, salt)):
                assert t is not None
                nbytes += t.numel() * t.element_size()
    read_s = time.perf_counter() - t1
    return {**out, "startup_requests": startup, "startup_s": round(startup_s, 3),
            "read_gets": store.durable.layout.requests.since(before)["GET"],
            "read_mb_per_s": round(nbytes / read_s / 1e6, 2)}


def lookup_keys(args: argparse.Namespace, salt: str) -> list[str]:
    """The first `--lookup-keys` distinct block keys of the shard (prompts in order)."""
    out: dict[str, None] = {}
    for p in range(args.shard):
        for k in prompt_keys(p, args, salt):
            out[k] = None
        if len(out) >= args.lookup_keys:
            break
    return list(out)[: args.lookup_keys]


def cross_run_lookup(url: str, opts: dict[str, Any], args: argparse.Namespace, keys: list[str]) -> dict[str, Any]:
    """A fresh reader asking the index whether the store holds `keys`: requests, bytes, seconds."""
    t0 = time.perf_counter()
    looker = open_store(url, opts, args)
    lay, nbytes = looker.durable.layout, [0]
    real_get, real_ranges = lay.get, lay.get_ranges

    def get(path):
        out = real_get(path)
        nbytes[0] += len(out)
        return out

    def get_ranges(paths, starts, ends):
        out = real_ranges(paths, starts, ends)
        nbytes[0] += sum(len(b) for b in out if isinstance(b, bytes | bytearray))
        return out

    lay.get, lay.get_ranges = get, get_ranges
    assert all(looker.contains(keys))
    return {"keys": len(keys), "requests": dict(looker.request_counts()), "bytes": nbytes[0],
            "s": round(time.perf_counter() - t0, 3)}


@contextlib.contextmanager
def reads_as(layout: str):
    """Before issue 14 a reader asked one range per block (concurrently); now neighbours coalesce."""
    if layout != "before":
        yield
        return
    # Both users of coalesce_ranges: the tier's block reads and the layout's index-range reads.
    users = (object_tier, object_layout)
    real = [m.coalesce_ranges for m in users]

    def one_per_block(ranges):
        return [p for p, _, _ in ranges], [s for _, s, _ in ranges], [e for _, _, e in ranges], \
            [[i] for i in range(len(ranges))]

    for m in users:
        m.coalesce_ranges = one_per_block
    try:
        yield
    finally:
        for m, fn in zip(users, real):
            m.coalesce_ranges = fn


def throughput(url: str, opts: dict[str, Any], args: argparse.Namespace, layout: str) -> dict[str, Any]:
    """Range reads of full-size blocks (256 KiB: about SmolLM2's bf16 block) in chains of 8."""
    big = torch.zeros((30, 2, 16, 3, 45), dtype=torch.float16)  # 259,200 bytes
    store = open_store(url, opts, args)
    chains = [[hashlib.sha256(f"{url}/{c}/{i}".encode()).hexdigest() for i in range(8)] for c in range(args.chains)]
    for keys in chains:
        store.put_many([(k, big) for k in keys])
        if layout == "before":
            store.flush()
    store.flush()
    reader = open_store(url, opts, args)
    before = reader.request_counts()
    t0 = time.perf_counter()
    with reads_as(layout):
        got = [t for keys in chains for t, _ in reader.get_many(keys)]
    wall = time.perf_counter() - t0
    assert all(t is not None for t in got)
    nbytes = sum(t.numel() * t.element_size() for t in got)
    return {"chains": len(chains), "block_bytes": big.numel() * 2, "gets": reader.durable.layout.requests.since(before)["GET"],
            "mb_per_s": round(nbytes / wall / 1e6, 1)}


def two_nights(url: str, opts: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from kvbatch.io.kvstore.store import kv_gc, kv_stats

    real_time = time.time
    time.time = lambda: real_time() - 10 * 86400  # night 1 was ten days ago
    try:
        night1 = open_store(url, opts, args)
        prefill(night1, range(args.shard), args, "night1", "segments")
    finally:
        time.time = real_time
    night2 = open_store(url, opts, args)
    shared = [k for p in range(args.shard) for k in prompt_keys(p, args, "night1")[: args.shared_blocks]]
    tails = [hashlib.sha256(f"night2/{p}".encode()).hexdigest() for p in range(args.shard)]
    served = sum(night2.contains(shared))
    got = night2.get_many(shared)  # decode loads them: their segments are recorded as used
    night2.put_many([(k, PAYLOAD) for k in tails])  # night 2's own tails
    night2.stats()  # the end of night 2: flush, usage recorded
    before = kv_stats(url, opts)
    # The gc after night 2 rewrites night 1's mostly-dead segments (their one-off tails) and keeps
    # the old ones for the grace (24 h); the next night's gc deletes them.
    gc = kv_gc(url, None, None, storage_options=opts, unused_s=3 * 86400)
    gc_next = kv_gc(url, None, None, storage_options=opts, unused_s=3 * 86400, now=time.time() + 25 * 3600)
    after_stats = kv_stats(url, opts)
    after = open_store(url, opts, args)
    kept = sum(after.contains(list(dict.fromkeys(shared)) + tails))
    one_offs = [k for p in range(args.shard) for k in prompt_keys(p, args, "night1")[args.shared_blocks:]]
    gone = sum(not c for c in after.contains(one_offs))
    keys_gc = ("packs_unused", "packs_kept", "segments_rewritten", "blocks_rewritten", "segments_awaiting_grace")
    return {"night2_shared_tokens_served_share": round(served / len(shared), 4),
            "loaded": sum(t is not None for t, _ in got), "gc": {k: gc[k] for k in keys_gc},
            "gc_next_night": {k: gc_next[k] for k in ("segments_replaced_deleted", "kv_bytes_reclaimed", "packs_kept")},
            "store_bytes_before_gc": before["kv_bytes"], "store_bytes_after": after_stats["kv_bytes"],
            "night2_blocks_kept_share": round(kept / (len(set(shared)) + len(tails)), 4),
            "night1_one_off_blocks_removed_share": round(gone / len(one_offs), 4)}


def cpu_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    keep = [f for f in flags if f.startswith(("avx512f", "avx2", "amx"))]
    return f"{fields.get('Model name', '?').strip()}, {os.cpu_count()} CPUs, flags {' '.join(keep)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="stores of 10^3 and 10^4 blocks")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="store sizes in blocks")
    ap.add_argument("--before-max", type=int, default=None,
                    help="largest store built in the old layout (it costs two PUTs per prompt)")
    ap.add_argument("--shard", type=int, default=1000, help="prompts in the decode shard")
    ap.add_argument("--lookup-keys", type=int, default=1000, help="distinct keys a cross-run lookup asks")
    ap.add_argument("--blocks-per-prompt", type=int, default=4)
    ap.add_argument("--shared-blocks", type=int, default=2)
    ap.add_argument("--group", type=int, default=10, help="prompts sharing a system prompt")
    ap.add_argument("--segment-mb", type=float, default=32.0)
    ap.add_argument("--chains", type=int, default=64, help="chains of 8 full-size blocks for the MB/s figure")
    ap.add_argument("--two-nights-only", action="store_true", help="only the two-nights figure")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = args.sizes or ([1_000, 10_000] if args.quick else [10_000, 100_000])
    before_max = args.before_max if args.before_max is not None else (10_000 if args.quick else 20_000)
    if args.quick:
        args.shard, args.chains = min(args.shard, 250), min(args.chains, 16)

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"key": "bench", "secret": "bench", "endpoint_url": f"http://{host}:{port}"}
    fs = s3fs.S3FileSystem(**opts)
    print(f"# CPU: {cpu_line()} (the machine may be shared)", file=sys.stderr)
    results: dict[str, Any] = {"cpu": cpu_line(), "command": " ".join(["python", *sys.argv]), "runs": []}
    try:
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        fs.mkdir(bucket)
        results["two_nights"] = two_nights(f"s3://{bucket}/kv", opts, args)
        print(json.dumps({"two_nights": results["two_nights"]}), flush=True)
        for layout in () if args.two_nights_only else ("before", "segments"):
            for size in sizes:
                if layout == "before" and size > before_max:
                    continue
                bucket = f"bench-{uuid.uuid4().hex[:10]}"
                fs.mkdir(bucket)
                url = f"s3://{bucket}/kv"
                store = open_store(url, opts, args)
                # Unique blocks per prompt: its own, plus its share of the group's system prompt.
                unique = args.blocks_per_prompt - args.shared_blocks + args.shared_blocks / args.group
                n_prompts = max(int(size / unique), args.shard)
                salt = uuid.uuid4().hex
                # Per 1,000 prompts prefilled (the first thousand), then the rest of the store.
                first = prefill(store, range(min(1000, n_prompts)), args, salt, layout)
                if n_prompts > 1000:
                    prefill(store, range(1000, n_prompts), args, salt, layout)
                locations = None
                lookups: dict[str, Any] = {}
                if layout == "segments":
                    # Prefill's manifests carry the shard's block locations; the nightly gc compacts
                    # the index (here as if it ran hours after the writes). A cross-run lookup of
                    # `--lookup-keys` keys through whole partitions (the reader before pages), then
                    # through paged partitions, each after its own compaction, in this run.
                    shard = [k for p in range(args.shard) for k in prompt_keys(p, args, salt)]
                    locations = store.locations(shard)
                    asked = lookup_keys(args, salt)
                    compact_index(store.durable.layout, now=time.time() + 2 * 3600, paged=False)
                    lookups["lookup_whole_partitions"] = cross_run_lookup(url, opts, args, asked)
                    t0 = time.perf_counter()
                    compacted = compact_index(store.durable.layout, now=time.time() + 3 * 3600)
                    compact_s = time.perf_counter() - t0
                    lookups["lookup_paged"] = cross_run_lookup(url, opts, args, asked)
                run = {"layout": layout, "store_blocks": store.durable.counters.blocks_written,
                       "prefill_per_1000_prompts": first, **lookups,
                       **startup_and_read(url, opts, args, salt, layout, locations)}
                if locations is not None:
                    run["compact"] = {"s": round(compact_s, 2), "segments": compacted["segments_indexed"],
                                      "partitions_written": compacted["partitions_written"]}
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
            bucket = f"bench-{uuid.uuid4().hex[:10]}"
            fs.mkdir(bucket)
            results.setdefault("range_reads", {})[layout] = throughput(f"s3://{bucket}/kv", opts, args, layout)
            print(json.dumps({layout: results["range_reads"][layout]}), flush=True)
    finally:
        server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
