"""Shard: tokenize the valid prompts and split them by a stable hash of ``custom_id``.

Plain Python (no Dagster); the pipeline's ``prompt_shards`` asset calls :func:`build_shards`.

Tokenization runs once, in input order, through the same :func:`tokenize_requests` as
``kvbatch generate``, so a row's ``prompt_token_ids`` are exactly what a sequential run would
compute; rows the template refuses or that do not fit the context window become rejects (row,
custom_id, field, reason), never dropped. A row's shard is ``sha256(custom_id) mod N``: stable
across runs, machines and Python versions (``hash()`` is salted per process), independent of
row order, so a re-ingested dataset puts every id in the same shard again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from kvbatch.engine.block_hash import store_fingerprint
from kvbatch.engine.llm import LLM, parse_dtype
from kvbatch.io.shard_tables import read_table, shard_url, write_table
from kvbatch.ops.batch_generate import Job, Rejected, tokenize_requests
from kvbatch.ops.ingest import PROMPTS_SCHEMA, REJECTS_SCHEMA, record_request, reject_record, request_record

SHARD_SCHEMA = pa.schema([
    *PROMPTS_SCHEMA,
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("block_keys", pa.list_(pa.string())),  # content keys of the prompt's full KV blocks
])


def shard_keys(num_shards: int) -> list[str]:
    """The shard partition keys: ``"0000"``, ``"0001"``... (zero-padded, so they sort)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return [f"{i:04d}" for i in range(num_shards)]


def shard_of(custom_id: str, num_shards: int) -> int:
    digest = hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % num_shards


def kv_fingerprint(model_fingerprint: str, dtype: str, block_size: int) -> str:
    """The KV store's fingerprint of a model's KV layout (the same as ``kvbatch prefill``'s)."""
    return store_fingerprint(model_fingerprint, str(parse_dtype(dtype)).removeprefix("torch."), block_size)


@dataclass
class ShardReport:
    rows: int = 0
    tokenized: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    rows_by_shard: dict[str, int] = field(default_factory=dict)
    prompt_tokens_by_shard: dict[str, int] = field(default_factory=dict)
    rejects_by_field: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def iter_prompts(table: pa.Table) -> Iterator[Any]:
    for batch in table.to_batches(max_chunksize=4096):
        for rec in batch.to_pylist():
            yield record_request(rec)


def build_shards(
    llm: LLM,
    prompts_url: str,
    root: str,
    num_shards: int,
    *,
    table: str = "shards",
    rejects_url: str,
    storage_options: Mapping[str, Any] | None = None,
) -> ShardReport:
    """Tokenize ``prompts_url`` and write ``<root>/<table>/shard=XXXX/part.parquet`` for every
    shard (empty ones too, so every partition has a committed table), plus the tokenization
    rejects at ``rejects_url``."""
    keys = shard_keys(num_shards)
    prompts = read_table(prompts_url, storage_options=storage_options)
    report = ShardReport(rows=prompts.num_rows)
    buckets: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    rejects: list[dict[str, Any]] = []
    requests = list(iter_prompts(prompts))
    for item in tokenize_requests(llm, iter(requests)):
        if isinstance(item, Rejected):
            report.rejected += 1
            report.rejects_by_field[item.row.field] = report.rejects_by_field.get(item.row.field, 0) + 1
            rejects.append(reject_record(item.row))
            continue
        assert isinstance(item, Job)
        rec = request_record(requests[item.index])
        rec["prompt_token_ids"] = item.prompt_token_ids
        rec["block_keys"] = llm.prompt_block_keys(item.prompt_token_ids)
        key = keys[shard_of(item.custom_id, num_shards)]
        buckets[key].append(rec)
        report.tokenized += 1
        report.prompt_tokens += len(item.prompt_token_ids)
        report.prompt_tokens_by_shard[key] = report.prompt_tokens_by_shard.get(key, 0) + len(item.prompt_token_ids)
    for key, rows in buckets.items():
        write_table(pa.Table.from_pylist(rows, SHARD_SCHEMA), shard_url(root, table, key),
                    storage_options=storage_options)
        report.rows_by_shard[key] = len(rows)
    write_table(pa.Table.from_pylist(rejects, REJECTS_SCHEMA), rejects_url, storage_options=storage_options)
    return report
