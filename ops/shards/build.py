"""Shard: tokenize the valid prompts and split them by a stable hash of ``custom_id``.

Plain Python (no Dagster); the pipeline's ``prompt_shards`` asset calls :func:`build_shards`.

Tokenization goes through the same per-row checks (:func:`~kvbatch.ops.jobs.prompt_ids`) as ``kvbatch generate``,
so a row's ``prompt_token_ids`` are exactly what a sequential run would compute; rows the
template refuses or that do not fit the context window become rejects (row, custom_id, field,
reason), never dropped. With ``tokenize_workers > 1`` a pool of spawned processes tokenizes
chunks of rows, each worker holding a tokenizer rebuilt once from the checkpoint's tokenizer
source (no weights); results are consumed in submission order, so shard files, rejects and
their order are those of the sequential path. A row's shard is ``sha256(custom_id) mod N``: stable
across runs, machines and Python versions (``hash()`` is salted per process), independent of
row order, so a re-ingested dataset puts every id in the same shard again.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbatch.engine.models.weights import TokenizerSource
from kvbatch.engine.runtime.block_hash import chain_keys
from kvbatch.engine.spec import EngineSpec
from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.engine.text.tool_calls import HERMES, is_tools_spec, with_format
from kvbatch.io.batch_requests import ChatRequest, RejectedRow
from kvbatch.io.prompt_table import (
    PROMPTS_SCHEMA,
    REJECTS_SCHEMA,
    record_request,
    reject_record,
    request_record,
)
from kvbatch.io.shard_tables import join, shard_url
from kvbatch.ops.fingerprint import model_identity
from kvbatch.ops.ingest.prompts import TableStream
from kvbatch.ops.jobs import Rejected, prompt_ids, tokenize_requests, tool_control_token, with_tool_format
from kvbatch.ops.shards.prompt_columns import ColumnarTokenizer
from kvbatch.ops.shards.prompt_tokens import CachedChatEncoder
from kvbatch.ops.shards.routing import DEFAULT_MAX_ROWS_PER_SHARD, shard_index, shard_keys, shard_of, shards_for_rows
from kvbatch.ops.shards.spill import ShardSpill
from kvbatch.ops.tokenizer_source_cache import kept_tokenizer_source

if TYPE_CHECKING:  # the shard step tokenizes without torch; a loaded LLM is one thing it accepts
    from kvbatch.engine.runtime.llm import LLM

SHARD_SCHEMA = pa.schema([
    *PROMPTS_SCHEMA,
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("block_keys", pa.list_(pa.string())),  # content keys of the prompt's full KV blocks
])
# Row-group min/max only for the scalar columns: a Parquet writer holds every row group's
# statistics until it closes, and with message contents and block keys among them each of a
# night's thousand open shard files grew by ~4 MB per 100,000 input rows (1,000,000 rows into 100
# shards: peak RSS 777 MB against 357 at 100,000 rows). A response format (a JSON schema, up to
# kilobytes: PROMPTS_SCHEMA's ``response_format``) is as long as a message and no one filters by it;
# so is a completions row's raw ``prompt``.
SHARD_STATISTICS_COLUMNS = [f.name for f in SHARD_SCHEMA
                            if not pa.types.is_nested(f.type) and f.name not in ("model", "response_format", "prompt")]


@dataclass
class ShardReport:
    rows: int = 0
    tokenized: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    rows_by_shard: dict[str, int] = field(default_factory=dict)
    prompt_tokens_by_shard: dict[str, int] = field(default_factory=dict)
    rejects_by_field: dict[str, int] = field(default_factory=dict)
    tokenize_workers: int = 1  # processes that tokenized (1: this process)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def iter_prompt_batches(url: str, *, batch_rows: int = 4096,
                        storage_options: Mapping[str, Any] | None = None) -> Iterator[list[dict[str, Any]]]:
    """The prompts table a record batch at a time (never the whole table in memory)."""
    for batch in iter_prompt_record_batches(url, batch_rows=batch_rows, storage_options=storage_options):
        yield batch.to_pylist()


def iter_prompt_record_batches(url: str, *, batch_rows: int = 4096,
                               storage_options: Mapping[str, Any] | None = None) -> Iterator[pa.RecordBatch]:
    """The prompts table as Arrow record batches of ``batch_rows`` (the columnar path)."""
    with fsspec.open(url, "rb", **dict(storage_options or {})) as f:
        yield from pq.ParquetFile(f).iter_batches(batch_size=batch_rows)


# ---------------------------------------------------------------- tokenizing, in order


@dataclass(frozen=True)
class Tokenized:
    """A row that fits: its prompt ids and the content keys of its full KV blocks."""

    prompt_token_ids: list[int]
    block_keys: list[str]


def tokenized_in_process(llm: LLM | RowTokenizer, batches: Iterable[list[ChatRequest]]
                         ) -> Iterator[tuple[ChatRequest, Tokenized | RejectedRow]]:
    """Every request with its outcome, in input order, tokenized in this process: by the
    :class:`RowTokenizer` (no weights, repeated text tokenized once) or by a loaded ``LLM``'s
    own tokenizer, row by row (the reference the tests hold the others to)."""
    if isinstance(llm, RowTokenizer):
        tokenizer = llm.build()
        for requests in batches:
            yield from zip(requests, llm.tokenize(tokenizer, requests), strict=True)
        return
    for requests in batches:
        for req, item in zip(requests, tokenize_requests(llm, iter(requests)), strict=True):
            if isinstance(item, Rejected):
                yield req, item.row
            else:
                yield req, Tokenized(item.prompt_token_ids, llm.prompt_block_keys(item.prompt_token_ids))


@dataclass(frozen=True)
class RowTokenizer:
    """What a worker process needs to tokenize rows as ``llm`` does: plain, picklable data (the
    tokenizer files or GGUF tokenizer metadata, the context window, the KV key root), no weights.
    :meth:`for_model` makes one without loading the weights at all (the fingerprint comes from
    :mod:`kvbatch.ops.fingerprint`); :meth:`of` takes it from an ``LLM`` already loaded."""

    source: TokenizerSource
    max_model_len: int
    kv_root_key: str
    block_size: int

    @classmethod
    def of(cls, llm: LLM) -> RowTokenizer:
        if llm.tokenizer is None:
            raise ValueError("chat requests need a model with a tokenizer")
        return cls(llm.checkpoint.tokenizer_source, llm.max_model_len, llm.kv_root_key,
                   llm.engine_config.block_size)

    @classmethod
    def for_spec(cls, spec: EngineSpec) -> RowTokenizer:
        """The tokenizer of ``spec``'s model as the engine built from ``spec`` would tokenize, from
        the tokenizer files and the kept model identity: no weights are read (but once, to
        fingerprint a model never seen before). The block keys are rooted as the engine's are
        (:meth:`~kvbatch.engine.spec.EngineSpec.kv_root_key`: weights, dtype, weight format, block size)."""
        identity = model_identity(spec.model)
        # An engine built from a spec takes the model's whole context window (EngineSpec sets no other).
        return cls(kept_tokenizer_source(spec.model), identity.max_position_embeddings,
                   spec.kv_root_key(identity.fingerprint), spec.block_size)

    def build(self) -> CachedChatEncoder:
        """The tokenizer, with repeated message text tokenized once (same ids as per row)."""
        return CachedChatEncoder(ChatTokenizer.from_source(self.source))

    def columnar(self) -> ColumnarTokenizer:
        """The tokenizer for whole record batches (same ids and keys as :meth:`tokenize`)."""
        return ColumnarTokenizer(self.build(), self.max_model_len, self.kv_root_key, self.block_size)

    def tokenize(self, tokenizer: ChatTokenizer | CachedChatEncoder, requests: list[ChatRequest]) -> list[Tokenized | RejectedRow]:
        out: list[Tokenized | RejectedRow] = []
        for req in requests:
            ids = prompt_ids(tokenizer, self.max_model_len, req)
            out.append(ids if isinstance(ids, RejectedRow) else
                       Tokenized(ids, chain_keys(self.kv_root_key, ids, self.block_size)))
        return out


class TokenizerWorkerError(RuntimeError):
    """A tokenizer worker process died (killed, out of memory, a crash in native code)."""


# The worker process's tokenizer, built once by the pool initializer (a process-wide slot is
# how ProcessPoolExecutor hands per-worker state to its tasks).
_worker_state: tuple[RowTokenizer, CachedChatEncoder] | None = None


def _init_worker(row_tokenizer_path: str) -> None:
    global _worker_state
    with open(row_tokenizer_path, "rb") as f:
        row_tokenizer: RowTokenizer = pickle.load(f)
    _worker_state = (row_tokenizer, row_tokenizer.build())


def _tokenize_chunk(requests: list[ChatRequest]) -> list[Tokenized | RejectedRow]:
    assert _worker_state is not None, "the pool initializer builds the tokenizer first"
    row_tokenizer, tokenizer = _worker_state
    return row_tokenizer.tokenize(tokenizer, requests)


def _chunks(batches: Iterable[list[ChatRequest]], chunk_rows: int) -> Iterator[list[ChatRequest]]:
    for requests in batches:
        for start in range(0, len(requests), chunk_rows):
            yield requests[start:start + chunk_rows]


def tokenized_in_pool(row_tokenizer: RowTokenizer, batches: Iterable[list[ChatRequest]], *, workers: int,
                      chunk_rows: int = 512) -> Iterator[tuple[ChatRequest, Tokenized | RejectedRow]]:
    """The same stream as :func:`tokenized_in_process`, tokenized by ``workers`` spawned processes
    (spawn, not fork: a forked child would inherit torch's OpenMP state and the parent's threads).

    Chunks of ``chunk_rows`` are submitted in input order and collected in the same order, with
    at most ``2 * workers`` chunks in flight, so memory stays bounded however long the input is.
    Close the generator (or exhaust it) to stop the pool."""
    # The tokenizer source (~1 MB) reaches the workers through a file, not as an initializer
    # argument: spawn writes a worker's arguments into a pipe whose read end the parent keeps
    # open until the write ends, so a worker that dies while starting would hang the parent
    # on any payload larger than the pipe buffer, instead of breaking the pool.
    spec_dir = tempfile.TemporaryDirectory(prefix="kvbatch-tokenizer-")
    spec_path = os.path.join(spec_dir.name, "row_tokenizer.pickle")
    with open(spec_path, "wb") as f:
        pickle.dump(row_tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(spec_path,))
    pending: deque[tuple[list[ChatRequest], Future[list[Tokenized | RejectedRow]]]] = deque()

    def died(first: ChatRequest, last: ChatRequest) -> TokenizerWorkerError:
        return TokenizerWorkerError(
            f"a tokenizer worker process died (crashed, killed or out of memory) while input rows "
            f"{first.line_no}..{last.line_no} were in flight (from custom_id {first.custom_id!r})")

    broken: list[bool] = []  # set when a worker died: the pool's other workers are then killed

    def collect() -> Iterator[tuple[ChatRequest, Tokenized | RejectedRow]]:
        chunk, future = pending[0]
        try:
            results = future.result()
        except BrokenProcessPool as exc:
            broken.append(True)
            raise died(chunk[0], pending[-1][0][-1]) from exc
        pending.popleft()
        assert len(results) == len(chunk), "a worker answers every row of its chunk"
        yield from zip(chunk, results)

    try:
        for chunk in _chunks(batches, chunk_rows):
            try:
                future = pool.submit(_tokenize_chunk, chunk)
            except BrokenProcessPool as exc:  # a worker died since the last collect
                broken.append(True)
                raise died((pending[0][0] if pending else chunk)[0], chunk[-1]) from exc
            pending.append((chunk, future))
            if len(pending) >= 2 * workers:
                yield from collect()
        while pending:
            yield from collect()
    finally:
        if broken:
            _kill_workers(pool)
        pool.shutdown(wait=True, cancel_futures=True)
        spec_dir.cleanup()  # every worker has exited: none still needs the file


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """Kill a broken pool's remaining workers and wait for them (5 s each at most). Seen on CPython
    3.11 (a CI run, 2026-12-02): after one worker died, ``shutdown(wait=True)`` waited for 20+
    minutes on a worker the pool had just started and left blocked; killed, it returns. The pool
    keeps its processes in a private mapping: read defensively."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        with contextlib.suppress(Exception):
            proc.kill()
            proc.join(5)


def default_tokenize_workers() -> int:
    """min(4, the CPUs this process may run on): tokenizing is CPU-bound, and beyond a few
    workers the parent (reading, hashing, writing Parquet) becomes the bottleneck."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cpus))


def sized_shard_count(prompts_url: str, max_rows_per_shard: int = DEFAULT_MAX_ROWS_PER_SHARD, *,
                      max_shards: int | None = None, storage_options: Mapping[str, Any] | None = None) -> int:
    """The shard count of a prompts table sized by its data (:func:`shards_for_rows` of the row
    count in its footer), for :func:`build_shards`' ``num_shards``."""
    return shards_for_rows(_num_rows(prompts_url, storage_options), max_rows_per_shard, max_shards)


def _num_rows(url: str, storage_options: Mapping[str, Any] | None) -> int:
    with fsspec.open(url, "rb", **dict(storage_options or {})) as f:
        return pq.ParquetFile(f).metadata.num_rows


def remove_shards_from(root: str, table: str, first: int, *,
                       storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Delete every ``<root>/<table>/shard=K`` folder with K >= ``first``; the keys removed.

    A day re-sharded into fewer shards leaves the higher shards of the earlier run behind, and
    nothing would ever re-run them: their rows are in the new shards now, so a reader of the
    whole day (the rollup, ``read_shards``) would count them twice."""
    fs, base = fsspec.core.url_to_fs(join(root, table), **dict(storage_options or {}))
    base = base.rstrip("/")
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)]
    except FileNotFoundError:
        return []
    keys = [n.removeprefix("shard=") for n in names if n.startswith("shard=")]
    stale = sorted(k for k in keys if k.isdigit() and int(k) >= first)
    for key in stale:
        fs.rm(f"{base}/shard={key}", recursive=True)
    return stale


# ---------------------------------------------------------------- sharding


def build_shards(
    llm: LLM | RowTokenizer,
    prompts_url: str,
    root: str,
    num_shards: int,
    *,
    table: str = "shards",
    rejects_url: str,
    storage_options: Mapping[str, Any] | None = None,
    batch_rows: int = 4096,
    tokenize_workers: int | None = None,
    tokenize_chunk_rows: int = 512,
    pool_min_rows: int = 16384,
    path: Literal["columnar", "rows"] = "columnar",
) -> ShardReport:
    """Tokenize ``prompts_url`` with ``llm`` (a :class:`RowTokenizer`, no weights: what the
    pipeline passes; or a loaded ``LLM``) and write ``<root>/<table>/shard=XXXX/part.parquet`` for every
    shard (empty ones too, so every partition has a committed table), plus the tokenization
    rejects at ``rejects_url``. Streams: prompts are read ``batch_rows`` at a time and each shard
    is written as it fills; the files are committed together at the end (none on an error).

    ``tokenize_workers`` processes tokenize chunks of ``tokenize_chunk_rows`` rows (default
    :func:`default_tokenize_workers`; 1 tokenizes in this process). A table of fewer than
    ``pool_min_rows`` rows is tokenized in this process anyway: workers take ~1.4 s to start
    (spawn, imports, tokenizer build), and on a 2-core machine two workers only pay that back
    past ~12k rows. Either way the files are identical.

    ``path="columnar"`` (the default) tokenizes whole record batches in this process
    (:mod:`kvbatch.ops.shards.prompt_columns`: the template rendered once per conversation shape,
    distinct pieces tokenized together on every core, Arrow columns throughout) and ignores
    the worker settings; ``"rows"`` is the per-row path above. Both write the same rows."""
    if tokenize_workers is not None and tokenize_workers < 1:
        raise ValueError(f"tokenize_workers must be >= 1, got {tokenize_workers}")
    if tokenize_chunk_rows < 1:
        raise ValueError(f"tokenize_chunk_rows must be >= 1, got {tokenize_chunk_rows}")
    if path not in ("columnar", "rows"):
        raise ValueError(f"path must be 'columnar' or 'rows', got {path!r}")
    workers = tokenize_workers or default_tokenize_workers()
    keys = shard_keys(num_shards)
    report = ShardReport(rows_by_shard={k: 0 for k in keys})
    if path == "columnar":
        row_tokenizer = llm if isinstance(llm, RowTokenizer) else RowTokenizer.of(llm)
        return _build_shards_columnar(row_tokenizer, prompts_url, root, keys, report, table=table,
                                      rejects_url=rejects_url, storage_options=storage_options, batch_rows=batch_rows)

    def request_batches() -> Iterator[list[ChatRequest]]:
        for records in iter_prompt_batches(prompts_url, batch_rows=batch_rows, storage_options=storage_options):
            report.rows += len(records)
            yield [record_request(rec) for rec in records]

    if workers > 1 and _num_rows(prompts_url, storage_options) >= pool_min_rows:
        row_tokenizer = llm if isinstance(llm, RowTokenizer) else RowTokenizer.of(llm)
        rows = tokenized_in_pool(row_tokenizer, request_batches(), workers=workers,
                                 chunk_rows=tokenize_chunk_rows)
        report.tokenize_workers = workers
    else:
        rows = tokenized_in_process(llm, request_batches())

    found: list[ChatTokenizer] = []  # the tokenizer tool rows' specs are stamped with (ops.jobs)

    def tool_chat() -> ChatTokenizer:
        if not found:  # built at the first tool row: most files have none
            chat = llm.build().tokenizer if isinstance(llm, RowTokenizer) else llm.tokenizer
            assert chat is not None, "tokenizing needed the tokenizer already"
            found.append(chat)
        return found[0]

    # Every shard's file is open until the end: spooled, so each costs a local file, not an
    # object-store upload buffer in memory (a night has a thousand shards).
    writers = {k: TableStream(shard_url(root, table, k), SHARD_SCHEMA, storage_options=storage_options,
                              batch_rows=max(256, batch_rows // num_shards), spool=True,
                              statistics=SHARD_STATISTICS_COLUMNS) for k in keys}
    rejects = TableStream(rejects_url, REJECTS_SCHEMA, storage_options=storage_options, batch_rows=batch_rows)
    try:
        with closing(rows):  # stops the worker pool on an error too
            for req, outcome in rows:
                if isinstance(outcome, RejectedRow):
                    report.rejected += 1
                    report.rejects_by_field[outcome.field] = report.rejects_by_field.get(outcome.field, 0) + 1
                    rejects.add(reject_record(outcome))
                    continue
                if is_tools_spec(req.sampling.response_format):
                    req = with_tool_format(req, tool_chat())
                rec = request_record(req)
                rec["prompt_token_ids"] = outcome.prompt_token_ids
                rec["block_keys"] = outcome.block_keys
                key = keys[shard_of(req.custom_id, num_shards)]
                writers[key].add(rec)
                n_tokens = len(outcome.prompt_token_ids)
                report.tokenized += 1
                report.rows_by_shard[key] += 1
                report.prompt_tokens += n_tokens
                report.prompt_tokens_by_shard[key] = report.prompt_tokens_by_shard.get(key, 0) + n_tokens
    except BaseException:
        for w in (*writers.values(), rejects):
            w.abort()
        raise
    for w in writers.values():
        w.commit()
    rejects.commit()
    return report


def _with_tool_format(table: pa.Table, chat: ChatTokenizer) -> pa.Table:
    """The rows with their tools specs in the template's tool-call format (what
    :func:`~kvbatch.ops.jobs.with_tool_format` does to a row): the decode step's grammar and output
    parser read it from the spec. A Hermes spec is unchanged, so only other formats rewrite the column."""
    fmt = chat.tool_call_format
    if fmt is None or fmt == HERMES or "response_format" not in table.column_names:
        return table
    i = table.schema.get_field_index("response_format")
    column = table.column(i)
    if not pc.any(pc.starts_with(column.cast(pa.string()), '{"type":"tools"')).as_py():
        return table
    token = tool_control_token(chat, fmt)
    # A night holds few distinct tools specs: each is rewritten once, the column taken from them.
    text = column.cast(pa.string())
    distinct = pc.unique(text)
    rewritten = pa.array([with_format(v, fmt, token) if v is not None and is_tools_spec(v) else v
                          for v in distinct.to_pylist()], pa.string())
    values = pc.take(rewritten, pc.index_in(text, value_set=distinct))
    return table.set_column(i, table.schema.field(i), values.cast(column.type))


# Each record batch is split into one spilled piece per shard (ops/shards/spill.py): batches are
# read large enough that a shard's piece has about this many rows (fewer, larger pieces to read
# back), up to MAX_COLUMNAR_BATCH_ROWS rows in memory.
MIN_ROW_GROUP_ROWS = 64
MAX_COLUMNAR_BATCH_ROWS = 65_536


def columnar_batch_rows(batch_rows: int, num_shards: int) -> int:
    """Rows per record batch of the columnar shard step: at least ``batch_rows``, more when many
    shards would otherwise get pieces of a few rows each (1,000 shards from 4,096-row batches: 4
    rows a piece, 2.4 million pieces a night), bounded so a batch stays a few hundred MB at most."""
    return max(batch_rows, min(MAX_COLUMNAR_BATCH_ROWS, MIN_ROW_GROUP_ROWS * num_shards))


def _build_shards_columnar(row_tokenizer: RowTokenizer, prompts_url: str, root: str, keys: list[str],
                           report: ShardReport, *, table: str, rejects_url: str,
                           storage_options: Mapping[str, Any] | None, batch_rows: int) -> ShardReport:
    """:func:`build_shards` a record batch at a time: Arrow columns in, Arrow columns out."""
    tokenizer = row_tokenizer.columnar()
    num_shards = len(keys)
    # Rows go to a local spill file first, the shard files are written one at a time after
    # (ops/shards/spill.py: a thousand shard writers open at once would hold gigabytes).
    spill = ShardSpill(SHARD_SCHEMA, num_shards)
    rejects = TableStream(rejects_url, REJECTS_SCHEMA, storage_options=storage_options, batch_rows=batch_rows)
    rows_by_shard = np.zeros(num_shards, dtype=np.int64)
    tokens_by_shard = np.zeros(num_shards, dtype=np.int64)
    # Spill writes (lz4) run in one background thread (Arrow releases the GIL), overlapping the
    # next batch's tokenizing; one batch's writes in flight bounds memory.
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvbatch-shard-spill")
    in_flight: Future[None] | None = None

    def spill_pieces(pieces: list[tuple[int, pa.Table]], rejected: pa.Table | None) -> None:
        for s, piece in pieces:
            spill.add(s, piece)
        if rejected is not None:
            rejects.add_table(rejected)

    def write_shard(s: int, row_groups: Iterator[pa.Table]) -> None:
        # One shard file open per writing thread; spooled on an object store (uploaded at commit).
        writer = TableStream(shard_url(root, table, keys[s]), SHARD_SCHEMA, storage_options=storage_options,
                             spool=True, statistics=SHARD_STATISTICS_COLUMNS)
        try:
            for group in row_groups:
                writer.add_table(group)
        except BaseException:
            writer.abort()
            raise
        writer.commit()

    try:
        try:
            for batch in iter_prompt_record_batches(prompts_url, batch_rows=columnar_batch_rows(batch_rows, num_shards),
                                                    storage_options=storage_options):
                report.rows += batch.num_rows
                out = tokenizer.tokenize(batch)
                for r in out.rejects:
                    report.rejects_by_field[r.field] = report.rejects_by_field.get(r.field, 0) + 1
                ok_rows = np.flatnonzero(out.ok)
                shard = shard_index(pc.take(batch.column("custom_id"), pa.array(ok_rows)).to_pylist(), num_shards)
                order = np.argsort(shard, kind="stable")  # input order kept within each shard
                rows = ok_rows[order]
                token_ids, block_keys = out.take(rows)
                kept = (pa.Table.from_batches([batch]).take(pa.array(rows))
                        .append_column("prompt_token_ids", token_ids).append_column("block_keys", block_keys))
                kept = _with_tool_format(kept, tokenizer.encoder.tokenizer)
                n_tokens = np.asarray(pc.list_value_length(token_ids), dtype=np.int64)
                rows_by_shard += np.bincount(shard, minlength=num_shards)
                tokens_by_shard += np.bincount(shard[order], weights=n_tokens, minlength=num_shards).astype(np.int64)
                bounds = np.searchsorted(shard[order], np.arange(num_shards + 1))
                pieces = [(s, kept.slice(bounds[s], bounds[s + 1] - bounds[s]))
                          for s in range(num_shards) if bounds[s + 1] > bounds[s]]
                rejected = (pa.Table.from_pylist([reject_record(r) for r in out.rejects], REJECTS_SCHEMA)
                            if out.rejects else None)
                if in_flight is not None:
                    in_flight.result()
                in_flight = pool.submit(spill_pieces, pieces, rejected)
            if in_flight is not None:
                in_flight.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        # Every row is tokenized: now the shard files (every shard, empty ones too), each
        # committed when written; the rejects last.
        spill.write_shards(write_shard, threads=min(2, os.cpu_count() or 1))
    except BaseException:
        rejects.abort()
        raise
    finally:
        spill.close()
    rejects.commit()
    report.rejected = sum(report.rejects_by_field.values())
    report.tokenized = int(rows_by_shard.sum())
    report.prompt_tokens = int(tokens_by_shard.sum())
    report.rows_by_shard = {k: int(rows_by_shard[s]) for s, k in enumerate(keys)}
    report.prompt_tokens_by_shard = {k: int(tokens_by_shard[s]) for s, k in enumerate(keys) if rows_by_shard[s]}
    return report
