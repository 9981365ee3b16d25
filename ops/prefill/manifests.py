"""The hand-off from prefill to decode: one manifest line per input row, in input order.

Written by prefill (``kvbatch prefill``, the pipeline's ``prefill_kv``) and read by decode in
another process or machine (``kvbatch decode``, ``decode_results``, the decode worker group).
The line names the model, KV layout and block keys the prompt's KV was stored under, so decode
refuses manifests made for another model (:class:`ManifestMismatch`) instead of loading wrong KV.

Manifest line (JSONL), one per input row, in input order:
``{"v", "index", "custom_id", "line_no", "model", "fingerprint", "kv_root", "block_size", "dtype",
"prompt_token_ids", "block_keys", "block_locations", "sampling", "request_model"}`` (and ``"endpoint"``
for a ``/v1/responses`` or ``/v1/completions`` row: the shape decode answers it in; ``"n"``, 1 to
``MAX_CHOICES``, for a row of several choices; ``"echo"``, the prompt's text, for a ``/v1/completions``
row with ``echo``: decode puts it before the answer's text in the output line) or, for a rejected row,
``{"v", "index", "custom_id", "line_no", "rejected": {"field", "reason"}}``.

``block_locations`` (version 2) gives, for each of ``block_keys``, where the durable store holds
it: ``{"segment": "<fingerprint id>/<segment>", "segment_bytes", "key", "offset", "length",
"checksum", "range_checksum", "dtype", "shape"}``, or null for a block that could not be stored.
Prefill writes the lines after its blocks are flushed, so every location names a published
segment; decode hands them to the store (:meth:`KVStore.add_locations`) and reads the blocks with
no index request at all, so its start-up does not grow with the store. A version 1 line (no
locations) still reads: its blocks are found through the store's index.

Reading is an edge: a manifest may sit on a shared store for hours, so decode trusts none of
it. Rules, each a decision a user will ask about:

- Every line of the file (the bytes up to each ``\\n``; a last line without one counts too) is
  exactly one item, so a decode answers as many rows as the manifest has lines, in order: a
  job, or a rejected row. Blank lines, bad UTF-8, bad JSON, a non-object, a missing or
  mistyped field, a token id outside the model's vocabulary, an ``index`` that is not greater
  than every index before it (a duplicate or a line moved), block keys that are not the
  prompt's, sampling out of range: each is a rejected row naming the field (``manifest.<path>``,
  ``$`` for the whole line) and the reason, which starts with the manifest line number. The
  row keeps the request's ``custom_id`` and ``line_no`` when the line still gives them validly.
- The position in the stream, not the line's ``index``, orders the output: a tampered index
  can neither overwrite another row nor leave a hole.
- A well-formed line made for another model, dtype or block size is not a row problem but a
  whole-file one: :class:`ManifestMismatch`, as before; decoding it would load wrong KV.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import fsspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvbatch.engine.runtime.llm import LLM
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.text.structured import schema_error
from kvbatch.io.batch_requests import (
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    WHOLE_LINE,
    RejectedRow,
    StopString,
    Text,
    describe_validation_error,
    json_type,
)
from kvbatch.io.endpoints import MAX_CHOICES
from kvbatch.io.kvstore.index_files import IndexInvalid
from kvbatch.io.kvstore.tiers import check_key
from kvbatch.ops.jobs import Job, Rejected

MANIFEST_VERSION = 2  # 2: block_locations; lines of version 1 still read
_INT32_MAX = 2**31 - 1  # token ids, counts: what a tensor index holds
_IDENTITY = ("fingerprint", "kv_root", "block_size", "dtype")


class ManifestMismatch(ValueError):
    """The manifests were made for another model, dtype or block size than the decoder's."""


@dataclass(frozen=True)
class ManifestLine:
    """One line of a manifest file as read: its fields, or why it cannot be used.

    ``line`` is the 1-based line of the manifest file. ``problem`` (a (field, reason) pair) is
    set when the line cannot be used; ``fields`` is the parsed object whenever there is one, so
    a rejected row can still name the request.
    """

    line: int
    fields: dict[str, Any] | None
    problem: tuple[str, str] | None = None


def identity(llm: LLM) -> dict[str, Any]:
    return {"fingerprint": llm.checkpoint.fingerprint, "kv_root": llm.kv_root_key,
            "block_size": llm.engine_config.block_size, "dtype": str(llm.dtype).removeprefix("torch.")}


def manifest_line(llm: LLM, job: Job, model_name: str) -> dict[str, Any]:
    return {
        "v": MANIFEST_VERSION,
        "index": job.index,
        "custom_id": job.custom_id,
        "line_no": job.line_no,
        "model": model_name,
        **identity(llm),
        "prompt_token_ids": job.prompt_token_ids,
        "block_keys": llm.prompt_block_keys(job.prompt_token_ids),
        "sampling": dataclasses.asdict(job.sampling),
        "request_model": job.model,
        **({} if job.endpoint == CHAT_COMPLETIONS_URL else {"endpoint": job.endpoint}),  # the answer's shape
        **({} if job.n == 1 else {"n": job.n}),  # choices: decode runs n requests over the one prompt
        **({} if job.echo is None else {"echo": job.echo}),  # output only: decode's line starts with it
    }


# --------------------------------------------------------------------------------------------
# Edge schemas (pydantic): the shape prefill writes, strictly typed (no "5" -> 5, no true -> 1)

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
_Count = Annotated[int, Field(ge=0, le=_INT32_MAX)]
_Id = Annotated[Text, Field(min_length=1)]


_MAX_RESPONSE_FORMAT = 1 << 20  # bytes of a response format's canonical JSON


_BiasPair = Annotated[list[int | float], Field(min_length=2, max_length=2)]


class _Sampling(BaseModel):
    """The engine's SamplingParams as prefill wrote them (dataclasses.asdict); the bounds are
    those io.batch_requests puts on the request fields they came from."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    max_tokens: int = Field(ge=1, le=_INT32_MAX)
    temperature: float = Field(ge=0.0, le=2.0)
    top_p: float = Field(gt=0.0, le=1.0)
    top_k: _Count
    min_p: float = Field(ge=0.0, le=1.0)
    seed: int | None = Field(ge=INT64_MIN, le=INT64_MAX)
    stop: list[StopString] = Field(max_length=MAX_STOP_SEQUENCES)
    stop_token_ids: list[int]  # range checked against the vocabulary: one message for every bad id
    logprobs: int | None = Field(ge=0, le=MAX_TOP_LOGPROBS)
    ignore_eos: bool
    # The canonical JSON of a constrained format (structured outputs), checked again below: a
    # line altered after prefill must not reach the grammar engine unchecked.
    response_format: str | None = Field(default=None, max_length=_MAX_RESPONSE_FORMAT)
    # OpenAI's logit bias, (token id, bias) pairs (ids checked against the vocabulary below, the
    # rest by the engine's SamplingParams), and the output penalties.
    logit_bias: list[_BiasPair] = Field(default=[], max_length=MAX_LOGIT_BIAS)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)


class _Head(BaseModel):
    """What every line has, the rejected form included."""

    model_config = _STRICT
    v: Literal[1, 2] | None = None
    index: _Count
    custom_id: _Id | None
    line_no: int = Field(ge=1, le=INT64_MAX)


class _Job(_Head):
    custom_id: _Id
    model: Text
    fingerprint: Text
    kv_root: Text
    block_size: int = Field(ge=1, le=_INT32_MAX)
    dtype: Text
    prompt_token_ids: list[int] = Field(min_length=1)
    block_keys: list[Text]
    block_locations: list[dict[str, Any] | None] | None = None  # checked in _check_locations
    sampling: _Sampling
    request_model: Text | None = None
    endpoint: Literal["/v1/chat/completions", "/v1/responses", "/v1/completions"] = CHAT_COMPLETIONS_URL
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    echo: Text | None = None


class _RejectedReason(BaseModel):
    model_config = _STRICT
    field: Text
    reason: Text


class _RejectedLine(_Head):
    rejected: _RejectedReason


# --------------------------------------------------------------------------------------------
# Reading


def read_manifests(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[ManifestLine]:
    """Stream a manifest file: one :class:`ManifestLine` per line, in order (see the module rules).

    Checks what needs only the line and the lines before it (bytes, JSON, an object, the
    ``index`` order); :func:`manifest_jobs` checks the rest against the model.
    """
    last_index = -1
    with fsspec.open(url, "rb", **(storage_options or {})) as f:
        for line, raw in enumerate(f, start=1):
            item = _parse_line(raw, line)
            if item.fields is not None:
                index = item.fields.get("index")
                if isinstance(index, int) and not isinstance(index, bool):
                    if index <= last_index:
                        what = "repeats" if index == last_index else "goes back from"
                        reason = f"{index} {what} index {last_index} of an earlier line: a duplicated or moved line"
                        item = ManifestLine(line, item.fields, ("index", reason))
                    else:
                        last_index = index
            yield item


def _parse_line(raw: bytes, line: int) -> ManifestLine:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return ManifestLine(line, None, (WHOLE_LINE, f"invalid UTF-8 at byte offset {e.start}"))
    if not text.strip():
        return ManifestLine(line, None, (WHOLE_LINE, "blank line"))
    try:
        obj = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer longer than Python's digit limit
        return ManifestLine(line, None, (WHOLE_LINE, f"malformed JSON: {getattr(e, 'msg', str(e))}"))
    except RecursionError:
        return ManifestLine(line, None, (WHOLE_LINE, "malformed JSON: nested too deeply"))
    if not isinstance(obj, dict):
        return ManifestLine(line, None, (WHOLE_LINE, f"must be a JSON object, got {json_type(obj)}"))
    return ManifestLine(line, obj)


def manifest_jobs(llm: LLM, manifests: Iterable[ManifestLine | dict[str, Any]]) -> Iterator[Job | Rejected]:
    """Turn manifest lines into engine jobs, one item per line: a bad line is a :class:`Rejected`.

    Refuses (ManifestMismatch) at the first well-formed line made for another model or layout.
    A plain dict is taken as a line read at its position (for callers that build manifests).
    """
    want = identity(llm)
    vocab = llm.model_config.vocab_size
    for position, item in enumerate(manifests):
        if not isinstance(item, ManifestLine):
            item = ManifestLine(position + 1, item) if isinstance(item, dict) else \
                ManifestLine(position + 1, None, (WHOLE_LINE, f"must be a JSON object, got {json_type(item)}"))
        yield _job(llm, want, vocab, position, item)


def _job(llm: LLM, want: dict[str, Any], vocab: int, position: int, item: ManifestLine) -> Job | Rejected:
    m = item.fields
    if item.problem is not None or m is None:
        return _bad(position, item.line, m, *(item.problem or (WHOLE_LINE, "no fields")))
    if "rejected" in m:
        try:
            r = _RejectedLine.model_validate(m)
        except ValidationError as e:
            return _bad(position, item.line, m, *describe_validation_error(e))
        return Rejected(position, RejectedRow(r.line_no, r.custom_id, r.rejected.field, r.rejected.reason))
    try:
        j = _Job.model_validate(m)
    except ValidationError as e:
        return _bad(position, item.line, m, *describe_validation_error(e))
    got = {k: getattr(j, k) for k in _IDENTITY}
    if got != want:
        diff = ", ".join(f"{k}: manifest {got[k]!r} vs decoder {want[k]!r}" for k in want if got[k] != want[k])
        raise ManifestMismatch(f"manifest line {item.line} ({j.custom_id!r}) was made for another model or "
                               f"layout ({diff})")
    ids = j.prompt_token_ids
    problem = (_out_of_vocab(ids, vocab, "prompt_token_ids")
               or _out_of_vocab(j.sampling.stop_token_ids, vocab, "sampling.stop_token_ids")
               or _out_of_vocab([int(p[0]) for p in j.sampling.logit_bias], vocab, "sampling.logit_bias"))
    if problem is None and len(ids) >= llm.max_model_len:
        problem = ("prompt_token_ids", f"prompt is {len(ids)} tokens; the context window is {llm.max_model_len}")
    if problem is None:
        problem = _check_block_keys(llm, j.block_keys, ids)
    if problem is None and j.block_locations is not None:
        problem = _use_locations(llm, j.block_keys, j.block_locations, item.line)
    if problem is None and j.sampling.response_format is not None:
        problem = _format_problem(j.sampling.response_format)
    if problem is None and j.echo is not None:
        problem = _echo_problem(j)
    if problem is not None:
        return _bad(position, item.line, m, *problem)
    sp = j.sampling.model_dump()
    sp["stop"], sp["stop_token_ids"] = tuple(sp["stop"]), tuple(sp["stop_token_ids"])
    try:
        sampling = SamplingParams(**sp)
    except ValueError as exc:  # the engine's own guard; the schema above should have said so first
        return _bad(position, item.line, m, "sampling", str(exc))
    return Job(position, j.custom_id, j.line_no, list(ids), sampling, j.request_model, j.endpoint, n=j.n,
               echo=j.echo)


def _echo_problem(j: _Job) -> tuple[str, str] | None:
    """Why a line's ``echo`` cannot be honoured (the reader refuses these rows; a line altered
    after prefill must not write an answer the request could never have had), or None."""
    if j.endpoint != COMPLETIONS_URL:
        return "echo", f"only a /v1/completions row echoes its prompt, not a {j.endpoint} row"
    if j.sampling.logprobs is not None:
        return "echo", "cannot be combined with sampling.logprobs (no prompt logprobs)"
    return None


def _format_problem(response_format: str) -> tuple[str, str] | None:
    """Why a manifest's response format cannot be compiled (named like the request field), or None."""
    try:
        why = schema_error(response_format)
    except Exception as exc:  # noqa: BLE001 - any malformed format is this line's problem, never the run's
        why = f"not a response format: {type(exc).__name__}: {exc}"
    return None if why is None else ("sampling.response_format", why)


def _out_of_vocab(ids: list[int], vocab: int, field: str) -> tuple[str, str] | None:
    # min/max run in C; the position is looked for only once something is out of range.
    if not ids or (min(ids) >= 0 and max(ids) < vocab):
        return None
    i = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
    return f"{field}.{i}", f"token id {ids[i]} is outside the model's vocabulary [0, {vocab})"


def _check_block_keys(llm: LLM, keys: list[str], ids: list[int]) -> tuple[str, str] | None:
    for i, k in enumerate(keys):
        try:
            check_key(k)
        except ValueError as exc:
            return f"block_keys.{i}", str(exc)
    # The keys chain over the token ids from this model's root: any other list means the line
    # was altered after prefill wrote it.
    if keys != llm.prompt_block_keys(ids):
        return "block_keys", "do not match prompt_token_ids: the line was altered after prefill wrote it"
    return None


def attach_locations(llm: LLM, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lines with ``block_locations`` filled in from the store (one lookup for all their keys).

    Call it after the store's flush(): only blocks in a published segment have a location."""
    store = llm.connector.store if llm.connector is not None else None
    locate = getattr(store, "locations", None)
    if locate is None:
        return lines
    keys = list(dict.fromkeys(k for line in lines for k in line.get("block_keys", ())))
    where = dict(zip(keys, locate(keys))) if keys else {}
    return [dict(line, block_locations=[where[k] for k in line["block_keys"]]) if "block_keys" in line else line
            for line in lines]


def _use_locations(llm: LLM, keys: list[str], locations: list[dict[str, Any] | None],
                   line: int) -> tuple[str, str] | None:
    """Check a line's block locations and hand them to the store; a problem names the field."""
    if len(locations) != len(keys):
        return "block_locations", f"{len(locations)} locations for {len(keys)} block keys"
    given = [(i, d) for i, d in enumerate(locations) if d is not None]
    for i, d in given:
        if d.get("key") != keys[i]:
            return f"block_locations.{i}.key", "is not the block key at the same position"
    add = getattr(llm.connector.store, "add_locations", None) if llm.connector is not None else None
    if add is None or not given:
        return None
    try:
        add([d for _, d in given], f"manifest line {line}")
    except IndexInvalid as exc:
        # The store names the position among the given ones: map it back to the line's own.
        pos, _, rest = exc.field.removeprefix("block_locations.").partition(".")
        i = given[int(pos)][0] if pos.isdigit() and int(pos) < len(given) else pos
        return f"block_locations.{i}{'.' + rest if rest else ''}", exc.reason
    return None


def _bad(position: int, line: int, m: dict[str, Any] | None, field: str, reason: str) -> Rejected:
    """A bad manifest line as a rejected row: the request's id and line number when the line still
    gives them validly, the manifest's line number otherwise (and always in the reason)."""
    cid = m.get("custom_id") if m is not None else None
    line_no = m.get("line_no") if m is not None else None
    if not isinstance(cid, str) or not cid or not _encodable(cid):
        cid = None
    if not isinstance(line_no, int) or isinstance(line_no, bool) or not 1 <= line_no <= INT64_MAX:
        line_no = line
    path = "manifest" if field == WHOLE_LINE else f"manifest.{field}"
    return Rejected(position, RejectedRow(line_no, cid, path, f"manifest line {line}: {reason}"))


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate would break the output writer, far from here
        return False
    return True
