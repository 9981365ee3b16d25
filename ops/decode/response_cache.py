"""The exact response cache across runs: an answer computed once is served again, bit for bit.

A night's rows are mostly last night's rows. :class:`ResponseCache` keeps every reproducible
answer the decode loop (:class:`~kvbatch.ops.decode.loop.DecodeLoop`) finishes, on any fsspec URL
(a local folder, ``file://``, ``s3://`` through s3fs), and the loop answers a row whose key it
holds from the entry, without the engine. Docs: ``docs/response-cache.md``.

**The key** (:func:`engine_identity`, :func:`row_key`) is the sha256 of

- the engine's identity, computed once per engine: the KV root key (the weights' fingerprint,
  the KV dtype with the weight format, the block size), the dtype, the weight format, the
  device type, the batch-invariant flag, the matmul precision, the CPU projection kernel
  option, the context window, the tokenizer and chat template
  (:func:`tokenizer_identity`: the tokenizer's whole serialization, the template, the special
  tokens, the EOS ids) and the engine's numerics version
  (:data:`~kvbatch.engine.runtime.engine_config.NUMERICS_VERSION`); for a sampled row, also the
  speculative-decoding config (:func:`drafting_identity`: drafts change which random draws a
  seeded row's tokens take), never for a greedy row, whose answer drafting does not change (the
  target model's argmax at every position; in deterministic mode bit for bit, logprobs included),
  so nights with and without drafts, or drafting from another night's answers, share greedy rows;
- the prompt's token ids (little-endian int32);
- the whole engine :class:`~kvbatch.engine.runtime.sampling_params.SamplingParams` dataclass,
  every field, serialized canonically (:func:`sampling_identity`): a field added later is in
  the key without a change here; a field value this module cannot serialize makes the row not
  reusable (never a key that ignores it). ``logit_bias`` and the presence and frequency penalties
  are fields like the others; the bias is held canonically (pairs sorted by token id, float
  biases), so one bias is one key however the row spelled it.

**Only reproducible rows** are looked up or written (:func:`reproducible`): greedy rows and
sampled rows with an explicit ``seed``. A sampled row without one gets its seed from the engine's
run-wide generator in arrival order (``LLM.add_request``), so its answer depends on the rows
before it: it is never served and never stored. Rows refused before the engine (errors) never
reach the cache. ``max_tokens`` is a field of the key, so a row cut by ``max_tokens`` is served
only to the same ``max_tokens``; with ``truncate`` (batch-invariant numerics, no drafter) each
answer is also kept under its :func:`family_key`, and a row asking fewer tokens is served by
cutting it where :func:`truncated` proves the cut equal to a recomputation.

**Entries** (:func:`encode_entry`): ``<root>/responses/v1/<key[:2]>/<key>.json``, one canonical
JSON object naming its format and its key, the answer (output token ids, text, finish reason,
logprobs, the drafter's counts) and the sha256 of key and answer. An entry that does not parse,
names another key or fails its checksum is a miss (``corrupt``), recomputed, and its object
replaced (deleted, then created again). Entries are written create-only
(:meth:`~kvbatch.io.kvstore.object_layout.ObjectLayout.put_new`): never overwritten, two writers of
one key harmless. Requests are counted by kind (GET, PUT, DELETE): a row costs one GET (a
miss is a GET that finds nothing), and a miss that is written one PUT. Lookups go
:data:`LOOKUP_BATCH` rows at a time (concurrent on an async store such as s3fs), writes through a
small thread pool, waited for at :meth:`ResponseCache.flush`.

**Use** is recorded for gc (:mod:`kvbatch.ops.decode.response_cache_gc`): the keys a run served
are written in a few create-only usage files when it flushes (:meth:`ResponseCache.record_usage`),
never a write per hit; ``kvbatch response-cache gc`` deletes the entries unused for N days.

**Verify** (``verify``, a fraction): a seeded sample of the hits (by key and ``verify_seed``) is
recomputed by the engine and compared with the entry (token ids, text, finish reason, logprobs);
a difference raises :class:`ResponseCacheMismatch` naming the row, after replacing the entry with
the recomputed answer.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import math
import sys
import threading
import time
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import fsspec

from kvbatch.engine.runtime.engine_config import NUMERICS_VERSION
from kvbatch.io.kvstore.object_layout import ObjectLayout
from kvbatch.io.urls import redact
from kvbatch.ops.decode.response_cache_gc import family_path

if TYPE_CHECKING:
    from kvbatch.engine.runtime.llm import LLM, Result
    from kvbatch.ops.jobs import Job

log = logging.getLogger("kvbatch.ops.decode.response_cache")

KEY_VERSION = 2  # the key's own layout (the fields below and how they are hashed)
ENTRY_FORMAT = "kvbatch-response-v1"
LOOKUP_BATCH = 64  # rows looked up together (one concurrent batch of GETs)
WRITE_THREADS = 8
FINISH_REASONS_STORED = ("stop", "length")


class ResponseCacheMismatch(Exception):
    """Verify mode: a cached answer differs from the engine's recomputation of the row."""


class _Unserializable(TypeError):
    pass


# -- the key ------------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """``value`` as plain JSON data, the same for equal values; :class:`_Unserializable` else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return {"float": repr(value)}
        return value
    if isinstance(value, enum.Enum):
        return {"enum": type(value).__name__, "value": _plain(value.value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"dataclass": type(value).__name__, "fields": _fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [_plain(v) for v in value]
        return {"set": sorted(items, key=lambda v: json.dumps(v, sort_keys=True))}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise _Unserializable(f"a dict with non-string keys: {value!r:.80}")
        return {"dict": {k: _plain(v) for k, v in sorted(value.items())}}
    raise _Unserializable(f"{type(value).__name__} value {value!r:.80}")


def _fields(obj: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(obj):
        if not f.compare:  # not part of the value (a speculative corpus's fsspec options, credentials)
            continue
        v = getattr(obj, f.name)
        # An int given where the field is a float (temperature 0 and 0.0) means the same thing.
        if isinstance(v, int) and not isinstance(v, bool) and str(f.type).strip() == "float":
            v = float(v)
        out[f.name] = _plain(v)
    return out


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def sampling_identity(params: Any) -> bytes:
    """Every field of the engine's SamplingParams, canonically (raises :class:`_Unserializable`)."""
    return canonical_json({"dataclass": type(params).__name__, "fields": _fields(params)})


def reproducible(params: Any) -> bool:
    """A row whose answer does not depend on the rows around it: greedy, or seeded."""
    return bool(params.greedy) or params.seed is not None


def tokenizer_identity(tokenizer: Any) -> str:
    """The tokenizer and chat template: the tokenizer's whole serialization, the template, the
    special tokens and the EOS ids."""
    if tokenizer is None:
        return "none"
    h = hashlib.sha256()
    to_json = getattr(tokenizer, "to_json", None)
    h.update((to_json() if to_json is not None else tokenizer._tok.to_str()).encode())
    h.update(b"\0")
    h.update(canonical_json({"chat_template": tokenizer.chat_template,
                             "special_tokens": _plain(tokenizer.special_tokens),
                             "eos_token_ids": sorted(tokenizer.eos_token_ids)}))
    return h.hexdigest()


def engine_identity(llm: LLM) -> str:
    """Everything about ``llm`` that can change an answer (see the module docstring)."""
    ec = llm.engine_config
    doc = {
        "key_version": KEY_VERSION,
        "numerics_version": NUMERICS_VERSION,
        "kv_root_key": llm.kv_root_key,  # weights fingerprint + KV dtype with weight format + block size
        "dtype": str(llm.dtype),
        "weights": ec.weights,
        "device": llm.device.type,
        "batch_invariant": ec.batch_invariant,
        "matmul_precision": ec.matmul_precision,
        "linear": ec.linear,
        "max_model_len": llm.max_model_len,
        "tokenizer": tokenizer_identity(llm.tokenizer),
        "eos_token_ids": sorted(llm.eos_token_ids),
    }
    return hashlib.sha256(canonical_json(doc)).hexdigest()


def drafting_identity(spec: Any) -> str | None:
    """The speculative-decoding config of an engine's ``spec`` (its ``config``), in a sampled
    row's key; None for an engine that does not draft."""
    if spec is None:
        return None
    return hashlib.sha256(canonical_json(_plain(spec.config))).hexdigest()


def sampled_identity(engine_id: str, drafting: str | None) -> str:
    """The engine identity a sampled row is keyed with: ``engine_id`` and the drafting config."""
    if drafting is None:
        return engine_id
    return hashlib.sha256(f"{engine_id}\0drafting:{drafting}".encode()).hexdigest()


def row_key(engine_id: str, prompt_token_ids: list[int], params: Any) -> str | None:
    """The row's key, or None when the row is not reproducible (or its parameters cannot be
    serialized)."""
    if not reproducible(params):
        return None
    try:
        sampling = sampling_identity(params)
    except _Unserializable as exc:
        log.warning("a row's sampling parameters hold %s: the row is not cached", exc)
        return None
    return _hash_parts(engine_id, sampling, prompt_token_ids)


def _hash_parts(engine_id: str, sampling: bytes, prompt_token_ids: list[int]) -> str:
    ids = array("i", prompt_token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.sha256()
    for part in (engine_id.encode(), sampling, ids.tobytes()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def family_key(engine_id: str, prompt_token_ids: list[int], params: Any) -> str | None:
    """The key shared by a row's answers at every ``max_tokens`` (every other field the same): where
    the longest answer is kept for :func:`truncated`. None when the row is not reproducible."""
    if not reproducible(params):
        return None
    try:
        fields = _fields(params)
    except _Unserializable:
        return None
    del fields["max_tokens"]
    sampling = canonical_json({"family": KEY_VERSION, "dataclass": type(params).__name__, "fields": fields})
    return _hash_parts(engine_id, sampling, prompt_token_ids)


def truncated(body: dict[str, Any], stored_max_tokens: int, max_tokens: int, tokenizer: Any) -> dict[str, Any] | None:
    """The answer the engine gives at ``max_tokens`` when ``body`` is its answer at
    ``stored_max_tokens`` (every other field the same, batch-invariant numerics, no drafter), or
    None where that is not proven. The engine emits the same token at each step whatever the limit
    (``max_tokens`` only ends a row: ``LLM._finish_reason``), and a row the stored answer carried
    past step k did not stop at k (no EOS, stop id or stop string), so:

    - ``max_tokens`` k below the answer's n tokens: its first k tokens, finish ``length``, the text
      those tokens detokenize to (no stop string matched: the engine's text is their decoding),
      the first k logprobs;
    - k at least n: the stored answer itself, when it ended by a stop (EOS, stop id, stop string),
      exactly at k, or by the context window (``length`` below its own limit); an answer cut by its
      own smaller ``max_tokens`` says nothing about the tokens after it.
    """
    if any(body.get(f) for f in ("spec_draft_tokens", "spec_accepted_tokens", "spec_target_steps")):
        return None  # a drafter's counts depend on the limit (its drafts are capped by it)
    ids, finish = body["output_token_ids"], body["finish_reason"]
    n, k = len(ids), max_tokens
    if k < n:
        if tokenizer is None:
            return None
        logprobs = body.get("logprobs")
        return {**body, "output_token_ids": ids[:k], "text": tokenizer.decode(ids[:k]), "finish_reason": "length",
                "logprobs": None if logprobs is None else logprobs[:k]}
    if finish == "stop" or n == k or (finish == "length" and n < stored_max_tokens):
        return dict(body)
    return None


# -- entries ------------------------------------------------------------------------------------

def result_body(result: Result) -> dict[str, Any]:
    """What an entry keeps of a finished request: everything its output line is made of."""
    return {
        "output_token_ids": list(result.output_token_ids),
        "text": result.text,
        "finish_reason": result.finish_reason,
        "logprobs": None if result.logprobs is None else [
            {**e, **({"top": [[int(i), lp] for i, lp in e["top"]]} if "top" in e else {})} for e in result.logprobs],
        "spec_draft_tokens": result.spec_draft_tokens,
        "spec_accepted_tokens": result.spec_accepted_tokens,
        "spec_target_steps": result.spec_target_steps,
    }


def _checksum(key: str, body: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json({"key": key, "body": body})).hexdigest()


def encode_entry(key: str, body: dict[str, Any]) -> bytes:
    """An entry's bytes: its format, its key, the answer and the sha256 of key and answer."""
    return canonical_json({"format": ENTRY_FORMAT, "key": key, "sha256": _checksum(key, body), "body": body}) + b"\n"


def decode_entry(key: str, data: bytes) -> dict[str, Any] | None:
    """The answer of an entry read for ``key``, or None for anything not a whole, valid entry of
    that key (cut short, flipped bytes, another key, another format)."""
    try:
        doc = json.loads(data)
        body = doc["body"]
        ok = (doc.get("format") == ENTRY_FORMAT and doc.get("key") == key and isinstance(body, dict)
              and doc.get("sha256") == _checksum(key, body)
              and isinstance(body.get("output_token_ids"), list) and isinstance(body.get("text"), str)
              and body.get("finish_reason") in FINISH_REASONS_STORED)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return body if ok else None


def result_from_body(request_id: str, prompt_token_ids: list[int], body: dict[str, Any]) -> Result:
    """The :class:`~kvbatch.engine.runtime.llm.Result` the engine gave when the entry was written
    (no timing: it took no engine time)."""
    from kvbatch.engine.runtime.llm import Result

    return Result(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                  output_token_ids=list(body["output_token_ids"]), text=body["text"],
                  finish_reason=body["finish_reason"], num_cached_tokens=0, ttft_s=0.0, tpot_s=None,
                  logprobs=body.get("logprobs"), spec_draft_tokens=int(body.get("spec_draft_tokens", 0)),
                  spec_accepted_tokens=int(body.get("spec_accepted_tokens", 0)),
                  spec_target_steps=int(body.get("spec_target_steps", 0)))


def difference(body: dict[str, Any], result: Result) -> str | None:
    """How a recomputed ``result`` differs from a cached ``body`` (None: the same answer)."""
    fresh = result_body(result)
    for name in ("output_token_ids", "text", "finish_reason", "logprobs"):
        if canonical_json(body.get(name)) != canonical_json(fresh[name]):
            return f"{name}: cached {json.dumps(body.get(name))[:120]}, recomputed {json.dumps(fresh[name])[:120]}"
    return None


# -- the store ----------------------------------------------------------------------------------

@dataclasses.dataclass
class ResponseCacheStats:
    hits: int = 0  # rows answered from an entry (verified ones included)
    misses: int = 0  # reproducible rows looked up and not found (or found corrupt)
    writes: int = 0  # entries created
    not_reusable: int = 0  # rows never looked up: sampled without a seed
    corrupt: int = 0  # entries that failed their checks (counted in misses too)
    read_errors: int = 0  # lookups that failed otherwise (counted in misses too)
    write_errors: int = 0
    already_present: int = 0  # writes that found the entry written (by another writer)
    verified: int = 0  # hits recomputed by verify mode and found equal
    output_tokens_served: int = 0
    usage_files: int = 0  # usage files written: the entries this run used, for gc (response_cache_gc.py)
    usage_errors: int = 0
    truncated: int = 0  # hits served by cutting a longer answer to the row's max_tokens (in hits too)
    family_writes: int = 0  # answers kept under their family key too (ResponseCache truncate)


class ResponseCache:
    """The response cache at ``url`` for an engine of identity ``engine_id`` (:func:`engine_identity`).

    ``verify``: the fraction of hits recomputed and compared (a sample seeded by ``verify_seed``).
    ``write``: False reads only. ``truncate`` (with the engine's ``tokenizer``): also keep each
    row's answer under its :func:`family_key` and serve a row with a smaller ``max_tokens`` from it
    (:func:`truncated`); only for an engine with batch-invariant numerics and no drafter, which
    :meth:`for_llm` checks. ``drafting``: the engine's :func:`drafting_identity`, in sampled rows'
    keys only. Thread-safe counters; :meth:`flush` waits for the writes."""

    def __init__(self, url: str, engine_id: str, *, verify: float = 0.0, verify_seed: int = 0,
                 storage_options: dict[str, Any] | None = None, write: bool = True, truncate: bool = False,
                 tokenizer: Any = None, drafting: str | None = None) -> None:
        if not 0.0 <= verify <= 1.0:
            raise ValueError(f"the response cache's verify fraction must be in [0, 1], got {verify}")
        self.url = url
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.layout = ObjectLayout(fs, root)
        self.engine_id = engine_id  # greedy rows' (drafting never changes them)
        self.sampled_engine_id = sampled_identity(engine_id, drafting)  # sampled rows'
        self.verify = verify
        self.verify_seed = verify_seed
        self.write = write
        self.stats = ResponseCacheStats()
        self._lock = threading.Lock()
        self._corrupt: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._used: set[str] = set()  # keys served since the last usage file (gc keeps them)
        self.truncate = truncate and tokenizer is not None
        self.tokenizer = tokenizer
        self._families: dict[str, tuple[str, int]] = {}  # key -> (family key, the row's max_tokens)

    @classmethod
    def for_llm(cls, url: str, llm: LLM, **kwargs: Any) -> ResponseCache:
        """The cache for ``llm``; a longer answer serves a smaller ``max_tokens`` where the engine's
        numerics are batch-invariant and it runs no drafter (where :func:`truncated` is proven)."""
        provable = bool(llm.engine_config.batch_invariant) and getattr(llm, "spec", None) is None
        kwargs.setdefault("truncate", provable)
        kwargs.setdefault("tokenizer", llm.tokenizer)
        kwargs.setdefault("drafting", drafting_identity(getattr(llm, "spec", None)))  # a LazyEngine's too, unbuilt
        # A LazyEngine knows its identity without being built (ops/decode/lazy_engine.py).
        engine_id = llm.__dict__.get("engine_id") or engine_identity(llm)
        return cls(url, engine_id, **kwargs)

    def path(self, key: str) -> str:
        return f"{self.layout.root}/responses/v1/{key[:2]}/{key}.json"

    def key(self, job: Job) -> str | None:
        engine_id = self.engine_id if job.sampling.greedy else self.sampled_engine_id
        key = row_key(engine_id, job.prompt_token_ids, job.sampling)
        if key is not None and self.truncate:
            family = family_key(self.engine_id, job.prompt_token_ids, job.sampling)
            if family is not None:
                with self._lock:
                    self._families[key] = (family, int(job.sampling.max_tokens))
        return key

    def family_path(self, family: str) -> str:
        return family_path(self.layout.root, family)

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    # -- reads --
    def lookup_many(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The valid entries among ``keys`` (one GET each, together); hits and misses not counted
        here (the loop counts what it serves)."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        self.layout.requests.add("GET", len(keys))
        try:
            # From byte 0 to the end: one GET each (a whole-object read makes s3fs ask for the size
            # first, a HEAD, and on a miss a LIST too).
            got = self.layout.fs.cat_ranges([self.path(k) for k in keys], 0, None, on_error="return")
        except Exception as exc:  # noqa: BLE001 - the store unreachable: every lookup is a miss
            log.warning("response cache %s: lookups failed (%s); the rows are recomputed", redact(self.url),
                        type(exc).__name__)
            self.count(read_errors=len(keys))
            return {}
        found: dict[str, dict[str, Any]] = {}
        for key, data in zip(keys, got):
            if isinstance(data, FileNotFoundError):
                continue
            if isinstance(data, Exception):
                # (An empty object is a failed ranged read on S3.) The row is recomputed and its
                # answer replaces what is there.
                self.count(read_errors=1)
                with self._lock:
                    self._corrupt.add(key)
                continue
            body = decode_entry(key, bytes(data))
            if body is None:
                self.count(corrupt=1)
                with self._lock:
                    self._corrupt.add(key)
                log.warning("response cache %s: entry %s is corrupt: a miss, recomputed", redact(self.url), key)
                continue
            found[key] = body
        with self._lock:
            self._used.update(found)  # every valid entry found is served (or verified): a use
            for key in found:  # held only until the row is answered (a night has millions)
                self._families.pop(key, None)
        if self.truncate:
            self._lookup_longer([k for k in keys if k not in found], found)
        return found

    def _lookup_longer(self, missed: list[str], found: dict[str, dict[str, Any]]) -> None:
        """Serve the ``missed`` keys whose row's answer at another ``max_tokens`` is kept under
        its family key and provably gives this one (:func:`truncated`); each such answer is also
        written under the row's own key, so the next run finds it in one GET."""
        with self._lock:
            wanted = {k: self._families[k] for k in missed if k in self._families and k not in self._corrupt}
        if not wanted:
            return
        families = list(dict.fromkeys(f for f, _ in wanted.values()))
        self.layout.requests.add("GET", len(families))
        try:
            got = self.layout.fs.cat_ranges([self.family_path(f) for f in families], 0, None, on_error="return")
        except Exception:  # noqa: BLE001 - the store unreachable: the rows are misses, recomputed
            return
        longest: dict[str, dict[str, Any]] = {}
        for family, data in zip(families, got):
            if isinstance(data, Exception):
                continue
            body = decode_entry(family, bytes(data))
            if body is not None and isinstance(body.get("max_tokens"), int):
                longest[family] = body
            else:  # corrupt: never served, and replaced by the next answer written under it
                with self._lock:
                    self._corrupt.add(family)
        for key, (family, max_tokens) in wanted.items():
            body = longest.get(family)
            if body is None:
                continue
            answer = truncated({k: v for k, v in body.items() if k != "max_tokens"}, body["max_tokens"], max_tokens,
                               self.tokenizer)
            if answer is None:
                continue
            found[key] = answer
            self.count(truncated=1)
            with self._lock:
                self._used.add(family)
                self._families.pop(key, None)
            if self.write:
                self._submit(self.path(key), key, encode_entry(key, answer), False)

    def should_verify(self, key: str) -> bool:
        if self.verify <= 0.0:
            return False
        draw = hashlib.sha256(f"verify:{self.verify_seed}:{key}".encode()).digest()
        return int.from_bytes(draw[:8], "big") / 2.0**64 < self.verify

    # -- writes --
    def put(self, key: str, result: Result, *, replace: bool = False) -> None:
        """Store ``result`` under ``key`` (in the background; :meth:`flush` waits). ``replace``:
        delete what is there first (an entry found wrong)."""
        if not self.write or result.finish_reason not in FINISH_REASONS_STORED:
            return
        body = result_body(result)
        self._submit(self.path(key), key, encode_entry(key, body), replace)
        with self._lock:
            family = self._families.pop(key, None)
        if family is not None:  # the answer at this max_tokens, for rows asking fewer (create-only: the first stays)
            name, max_tokens = family
            self._submit(self.family_path(name), name, encode_entry(name, {**body, "max_tokens": max_tokens}),
                         False, counter="family_writes")

    def _submit(self, path: str, key: str, data: bytes, replace: bool, counter: str = "writes") -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="kvbatch-response-cache")
        self._pending.append(self._pool.submit(self._put, path, key, data, replace, counter))
        if len(self._pending) >= 4 * WRITE_THREADS:
            self._pending = [f for f in self._pending if not f.done()]

    def _put(self, path: str, key: str, data: bytes, replace: bool, counter: str = "writes") -> None:
        try:
            with self._lock:
                replace = replace or key in self._corrupt
            if replace:
                self._delete(path)
            if self.layout.put_new(path, data):
                self.count(**{counter: 1})
            else:
                self.count(already_present=1)
        except Exception as exc:  # noqa: BLE001 - a failed write costs a recomputation later, never the run
            self.count(write_errors=1)
            log.warning("response cache %s: writing %s failed (%s)", redact(self.url), key, type(exc).__name__)

    def _delete(self, path: str) -> None:
        self.layout.requests.add("DELETE")
        try:
            self.layout.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def flush(self) -> None:
        """Wait for every write started; record the entries used since the last flush."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        self.record_usage()

    def record_usage(self, now: float | None = None) -> int:
        """Write which entries this run served since the last call, in usage files (a few per run,
        never a write per hit), so that ``kvbatch response-cache gc --unused-days`` keeps them;
        returns how many keys it named. Advisory, like the KV store's: a failure is logged and
        counted (``usage_errors``), and those entries then look unused for that one use."""
        from kvbatch.ops.decode.response_cache_gc import write_usage

        with self._lock:
            used, self._used = self._used, set()
        if not used or not self.write:
            return 0
        now = time.time() if now is None else now
        try:
            self.count(usage_files=write_usage(self.layout, dict.fromkeys(used, now), now))
        except Exception as exc:  # noqa: BLE001 - usage is advisory; the answers were served
            self.count(usage_errors=1)
            log.warning("response cache %s: cannot record the use of %d entries (%s)", redact(self.url), len(used),
                        type(exc).__name__)
        return len(used)

    def close(self) -> None:
        self.flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            out = dataclasses.asdict(self.stats)
        out["requests"] = {k: v for k, v in self.layout.requests.snapshot().items() if v}
        return out
