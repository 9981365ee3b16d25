"""The columnar shard path (:mod:`kvbatch.ops.shards.prompt_columns`) tokenizes a record batch exactly
as the per-row path does: ids, block keys and rejects equal ``RowTokenizer.tokenize`` on
generated conversations (shared system prompts, text that spells or almost spells control
tokens), templates that branch on or rewrite content are never spliced, and ``build_shards``
writes the same shard tables either way."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.engine.models.weights import load_tokenizer_source
from kvbatch.engine.runtime.block_hash import chain_keys
from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.io.batch_requests import ChatRequest, RejectedRow, SamplingParams
from kvbatch.io.prompt_table import PROMPTS_SCHEMA, record_request, request_record
from kvbatch.ops.ingest.prompts import ingest
from kvbatch.ops.shards.prompt_columns import ColumnarTokenizer, content_printed_only
from kvbatch.ops.shards.prompt_tokens import CachedChatEncoder
from kvbatch.ops.shards.routing import shard_index, shard_of
from kvbatch.ops.shards.build import RowTokenizer, build_shards
from kvbatch.ops.tokenizer_source_cache import kept_tokenizer_source

SYSTEM_PROMPTS = ["You are a careful editor. Summarise in three bullets.", "Answer in one word.\n\nNo greetings.",
                  "  leading and trailing spaces  "]
FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<|im_", "_end|>", "|>", "<", ">", "\n", " ", "\t", "system",
             "user", "ünïcödé", "数据", "123", "a", "word", "<think>", "'s", "  \n", "word " * 20]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer and chat template as a Hugging Face folder (no weights: nothing here
    loads a model)."""
    tok = ChatTokenizer.from_source(kept_tokenizer_source("smollm2-135m"))
    folder = tmp_path_factory.mktemp("tok")
    (folder / "tokenizer.json").write_text(tok._tok.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}))
    return folder


def test_the_gguf_tokenizer_is_read_once_and_kept_while_the_file_is_unchanged(monkeypatch):
    from kvbatch.ops import tokenizer_source_cache as cache

    first = cache.kept_tokenizer_source("smollm2-135m")  # read (or kept by the fixture above)
    assert first.kind == "gguf" and first.gguf_metadata["tokenizer.ggml.tokens"]

    def no_read(model):
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr(cache, "load_tokenizer_source", no_read)
    assert cache.kept_tokenizer_source("smollm2-135m") == first
    monkeypatch.setattr(cache, "model_stamp", lambda model: [["changed", 1, "", ""]])
    with pytest.raises(AssertionError, match="read again"):
        cache.kept_tokenizer_source("smollm2-135m")


def _with_template(tiny: Path, folder: Path, wrap) -> Path:
    folder = Path(shutil.copytree(tiny, folder))
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = wrap(config["chat_template"])
    path.write_text(json.dumps(config))
    return folder


def _row_tokenizer(folder: Path) -> RowTokenizer:
    """What ``RowTokenizer.of(LLM(folder, block_size=8))`` holds, without loading the weights
    (the KV root only needs to be the same on both paths)."""
    return RowTokenizer(load_tokenizer_source(str(folder)), 96, "ab" * 32, 8)


@pytest.fixture(scope="module")
def row_tokenizer(tiny) -> RowTokenizer:
    return _row_tokenizer(tiny)


@pytest.fixture(scope="module")
def reference(row_tokenizer) -> ChatTokenizer:
    """The per-row reference: ``encode_chat`` of a plain tokenizer, row by row."""
    return ChatTokenizer.from_source(row_tokenizer.source)


@pytest.fixture(scope="module")
def encoder(row_tokenizer) -> CachedChatEncoder:
    return row_tokenizer.build()


def _batch(conversations: list[list[dict]]) -> pa.Table:
    reqs = [ChatRequest(i + 1, f"id-{i}", m, SamplingParams(), None) for i, m in enumerate(conversations)]
    return pa.Table.from_pylist([request_record(r) for r in reqs], PROMPTS_SCHEMA)


def _per_row(row_tokenizer: RowTokenizer, table: pa.Table, tokenizer: ChatTokenizer | None = None) -> list:
    reqs = [record_request(r) for r in table.to_pylist()]
    out = row_tokenizer.tokenize(tokenizer or ChatTokenizer.from_source(row_tokenizer.source), reqs)
    return [(o.field, o.reason, o.line_no, o.custom_id) if isinstance(o, RejectedRow)
            else (o.prompt_token_ids, o.block_keys) for o in out]


def _columnar(tokenizer, table: pa.Table) -> tuple[list, int]:
    got = tokenizer.tokenize(table)
    rows = [int(i) for i in range(table.num_rows) if got.ok[i]]
    ids, keys = got.take(rows)
    ok = iter(zip(ids.to_pylist(), keys.to_pylist(), strict=True))
    rejects = iter(got.rejects)
    out = []
    for i in range(table.num_rows):
        if got.ok[i]:
            out.append(next(ok))
        else:
            r = next(rejects)
            out.append((r.field, r.reason, r.line_no, r.custom_id))
    return out, got.fast_rows


text = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6), max_size=10).map("".join)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": text})
system = st.fixed_dictionaries({"role": st.just("system"), "content": st.sampled_from(SYSTEM_PROMPTS) | text})
conversation = st.tuples(st.lists(system, max_size=1), st.lists(message, min_size=1, max_size=3)).map(
    lambda parts: parts[0] + parts[1])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations=st.lists(conversation, min_size=1, max_size=12))
def test_columnar_ids_keys_and_rejects_equal_the_per_row_path(row_tokenizer, reference, encoder, conversations):
    table = _batch(conversations + conversations[:3])  # repeats share a conversation
    tokenizer = ColumnarTokenizer(encoder, row_tokenizer.max_model_len, row_tokenizer.kv_root_key,
                                  row_tokenizer.block_size, max_pieces=8)  # small: evictions happen too
    assert _columnar(tokenizer, table)[0] == _per_row(row_tokenizer, table, reference)


def test_block_keys_are_the_engines_chain_keys(row_tokenizer, reference):
    ids = reference.encode_chat([{"role": "user", "content": "word " * 40}])
    tokenizer = row_tokenizer.columnar()
    assert tokenizer._block_keys(ids) == chain_keys(row_tokenizer.kv_root_key, ids, 8)
    assert len(tokenizer._block_keys(ids)) == len(ids) // 8


def test_plain_rows_are_spliced_and_each_piece_tokenized_once(row_tokenizer):
    """The fast path is taken (the property above would pass if every row went per row)."""
    conversations = [[{"role": "system", "content": SYSTEM_PROMPTS[i % 2]}, {"role": "user", "content": f"row {i}"}]
                     for i in range(40)] + [[{"role": "user", "content": "no system"}]] * 5
    table = _batch(conversations)
    tokenizer = row_tokenizer.columnar()
    out, fast = _columnar(tokenizer, table)
    assert out == _per_row(row_tokenizer, table)
    assert fast == table.num_rows
    # 40 "user\nrow i" pieces, 2 system pieces, the user piece of the last rows, the default
    # system prompt, "\n" and the generation prompt: each tokenized once.
    assert tokenizer.encoder.misses <= 40 + 2 + 1 + 3
    out2, _ = _columnar(tokenizer, table)
    assert out2 == out and tokenizer.encoder.misses <= 46  # the second batch hits the cache


def test_too_long_prompts_are_rejected_with_the_per_row_reason(row_tokenizer, reference):
    table = _batch([[{"role": "user", "content": "word " * 200}], [{"role": "user", "content": "short"}]])
    out, _ = _columnar(row_tokenizer.columnar(), table)
    assert out == _per_row(row_tokenizer, table, reference)
    assert out[0][0] == "body.messages" and "context window is 96" in out[0][1]


REFUSE = "REFUSE-ME"


@pytest.mark.parametrize("wrap", [
    lambda t: ("{% for message in messages %}{% if '" + REFUSE + "' in message['content'] %}"
               "{{ raise_exception('this conversation is refused') }}{% endif %}{% endfor %}") + t,
    lambda t: t.replace("message['content']", "message['content'] | trim"),
], ids=["branches-on-content", "trims-content"])
def test_templates_that_read_content_are_not_spliced(tiny, tmp_path, wrap):
    folder = _with_template(tiny, tmp_path / "tpl", wrap)
    assert not content_printed_only(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    rt = _row_tokenizer(folder)
    table = _batch([[{"role": "user", "content": f"  {REFUSE} {i} "}] for i in range(3)]
                   + [[{"role": "user", "content": " padded "}]])
    out, fast = _columnar(rt.columnar(), table)
    assert out == _per_row(rt, table) and fast == 0


def test_shapes_whose_probes_differ_are_not_spliced(tiny, tmp_path):
    """A template that prints content only but rewrites the whole render (a filter block, which
    the syntax check does not see as a use of content) fails a probe."""
    folder = _with_template(tiny, tmp_path / "tpl", lambda t: "{% filter upper %}" + t + "{% endfilter %}")
    rt = _row_tokenizer(folder)
    table = _batch([[{"role": "user", "content": "Mixed Case"}], [{"role": "system", "content": "s"},
                                                                 {"role": "user", "content": "u"}]])
    tokenizer = rt.columnar()
    out, fast = _columnar(tokenizer, table)
    assert out == _per_row(rt, table) and fast == 0


def test_a_batch_with_null_messages_takes_the_per_row_path(row_tokenizer, reference):
    table = _batch([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]])
    messages = pa.array([[{"role": "user", "content": None}], [{"role": "user", "content": "b"}]],
                        table.schema.field("messages").type)
    table = table.set_column(table.schema.get_field_index("messages"), "messages", messages)
    out, fast = _columnar(row_tokenizer.columnar(), table)
    assert out == _per_row(row_tokenizer, table, reference) and fast == 0


def test_shard_index_is_shard_of_for_a_column():
    ids = [f"id-{i}" for i in range(500)] + ["ünï", "数据", "x" * 300]
    assert shard_index(ids, 7).tolist() == [shard_of(c, 7) for c in ids]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=30), st.integers(1, 10_000))
def test_shard_index_equals_shard_of_for_any_ids_and_count(ids, num_shards):
    # The column form reads the digests' first 8 bytes with numpy; a row must land where
    # shard_of (the definition) puts it, for any text (surrogates included) and range width.
    got = shard_index(ids, num_shards)
    assert got.dtype == np.int64 and got.tolist() == [shard_of(c, num_shards) for c in ids]


def test_build_shards_columnar_writes_the_rows_of_the_per_row_path(row_tokenizer, tmp_path):
    rng = random.Random(3)
    words = ["the", "a", "book", "tent", "boot", "order", "refund", "ship", "winter", "zipper", "camp", "trail",
             "ünïcödé", "数据", "<|im_start|>"]
    rows = []
    for i in range(900):
        user = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        if i % 50 == 0:
            user = "word " * 150  # past the context window
        messages = [{"role": "user", "content": user}]
        if rng.random() < 0.6:
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        rows.append({"custom_id": f"req-{i:05d}", "messages": messages, "max_tokens": rng.randint(1, 9)})
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    ingest(str(tmp_path / "in.jsonl"), prompts, str(tmp_path / "rejects.parquet"))
    reports = {}
    for path in ("columnar", "rows"):
        out = tmp_path / path
        reports[path] = build_shards(row_tokenizer, prompts, str(out), 3, rejects_url=str(out / "shard_rejects.parquet"),
                                     batch_rows=250, path=path, tokenize_workers=1)
    assert reports["columnar"] == reports["rows"]
    assert reports["columnar"].rejected >= 18 and reports["columnar"].tokenized == 900 - reports["columnar"].rejected
    for f in sorted((tmp_path / "rows").rglob("*.parquet")):
        assert pq.read_table(f).equals(pq.read_table(tmp_path / "columnar" / f.relative_to(tmp_path / "rows"))), f


def test_columnar_batches_grow_with_the_shard_count_up_to_a_bound():
    from kvbatch.ops.shards.build import MAX_COLUMNAR_BATCH_ROWS, MIN_ROW_GROUP_ROWS, columnar_batch_rows

    assert columnar_batch_rows(4096, 8) == 4096  # few shards: the caller's batch
    assert columnar_batch_rows(4096, 1000) == MIN_ROW_GROUP_ROWS * 1000  # a night's shards: 64-row groups
    assert columnar_batch_rows(4096, 10_000) == MAX_COLUMNAR_BATCH_ROWS  # never more in memory


def test_build_shards_on_s3_spools_locally_and_writes_the_local_files(row_tokenizer, tmp_path, s3, monkeypatch):
    # Every shard file is open until the end of the step: on S3 each is written to a local spool
    # file and uploaded at commit, so no shard holds an upload buffer in memory. The objects
    # equal the files the same step writes locally, and no spool file is left behind.
    url, opts, fs = s3
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setenv("KVBATCH_SPOOL_DIR", str(spool))
    rows = [{"custom_id": f"s3-{i:04d}", "messages": [{"role": "user", "content": f"question {i % 7}"}]}
            for i in range(120)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    ingest(str(tmp_path / "in.jsonl"), prompts, str(tmp_path / "rejects.parquet"))
    import kvbatch.ops.ingest.prompts as ingest_module

    opened: dict[str, bool] = {}

    class RecordingSink(ingest_module.AtomicSink):
        def __init__(self, url, storage_options, *, spool=False):
            opened[url] = spool
            super().__init__(url, storage_options, spool=spool)

    monkeypatch.setattr(ingest_module, "AtomicSink", RecordingSink)
    local = build_shards(row_tokenizer, prompts, str(tmp_path / "local"), 5,
                         rejects_url=str(tmp_path / "local" / "shard_rejects.parquet"))
    remote = build_shards(row_tokenizer, prompts, url, 5, rejects_url=url + "/shard_rejects.parquet",
                          storage_options=opts)
    assert remote == local and list(spool.iterdir()) == []
    shard_files = [u for u in opened if u.startswith(url + "/shards/")]
    assert len(shard_files) == 5 and all(opened[u] for u in shard_files)
    for k in range(5):
        with fs.open(f"{url}/shards/shard={k:04d}/part.parquet", "rb") as f:
            assert pq.read_table(f).equals(pq.read_table(tmp_path / "local" / "shards" / f"shard={k:04d}" / "part.parquet"))


def test_the_shard_step_holds_at_most_one_shard_file_open_per_writing_thread(row_tokenizer, tmp_path, monkeypatch):
    # A Parquet writer keeps every row group's metadata until it closes: with a file per shard
    # open for the whole step, 1,000,000 rows into 100 shards doubled the step's peak RSS. The
    # rows are spilled first and the shard files written one at a time per thread (2 here).
    import kvbatch.ops.shards.build as shards_module

    open_now, most = 0, 0
    lock = __import__("threading").Lock()

    class CountingStream(shards_module.TableStream):
        def __init__(self, *args, **kwargs):
            nonlocal open_now, most
            super().__init__(*args, **kwargs)
            with lock:
                open_now += 1
                most = max(most, open_now)

        def commit(self):
            nonlocal open_now
            try:
                return super().commit()
            finally:
                with lock:
                    open_now -= 1

    monkeypatch.setattr(shards_module, "TableStream", CountingStream)
    rows = [{"custom_id": f"w-{i:04d}", "messages": [{"role": "user", "content": f"q {i % 5}"}]} for i in range(300)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    ingest(str(tmp_path / "in.jsonl"), prompts, str(tmp_path / "rejects.parquet"))
    report = build_shards(row_tokenizer, prompts, str(tmp_path / "out"), 40,
                          rejects_url=str(tmp_path / "out" / "shard_rejects.parquet"))
    assert report.tokenized == 300 and len(list((tmp_path / "out" / "shards").iterdir())) == 40
    assert most <= 3  # the rejects file (open throughout) and one shard per writing thread
