"""A run's engine built at the first response-cache miss: a repeated night whose every row is in
the cache never loads (reads, fingerprints, packs) the weights.

Answering a row from the cache needs little of the engine: the cache key's engine identity
(:func:`~kvbatch.ops.decode.response_cache.engine_identity`), the tokenizer and context window
(to tokenize the requests), its batch limit and whether it speculates (the loop and the report).
All but the identity come from the :class:`~kvbatch.engine.spec.EngineSpec` and the tokenizer's
files. The identity hashes what only a built engine knows for sure (the loaded weights'
fingerprint, its EOS ids, its context window), so :meth:`LazyEngine.open` builds the engine the
first time a spec is met on this machine and records the identity it computed; later runs read
the record. A record is found by everything the identity could depend on: the spec, the model
files' stamp (:func:`kvbatch.ops.fingerprint.model_stamp`: name, size, mtime and header of every
weight and config file), the tokenizer's identity, the cache key's layout version and the
engine's numerics version. When the engine is built after all (the first miss), its identity is
computed again and must equal the record's: if not, the record is removed and the run fails
loudly (:class:`EngineIdentityChanged`) rather than write answers under a wrong key.

One difference in the metrics: where the first miss builds the engine inside a batch, the
batch's ``wall_s`` includes that build (it is the time the run took); the engine's own counters
(steps, tokens, ``step_s``, ``draft_s``) start at zero either way.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvbatch.engine.runtime.llm import LLM
from kvbatch.engine.spec import EngineSpec

RECORD_VERSION = 1
# The engine's counters before it exists: what BatchReport.start reads.
_UNBUILT_STATS = {"draft_s": 0.0, "step_s": 0.0}


class EngineIdentityChanged(RuntimeError):
    """The engine built now has another identity than the record a run trusted for its cache keys."""


def identity_dir() -> Path:
    """Where identity records are kept: beside the weights fingerprints (``$KVBATCH_CACHE_DIR``)."""
    from kvbatch.kernels.cpu.machine import default_cache_dir

    return default_cache_dir() / "engine-identities"


def record_path(spec: EngineSpec, tokenizer_id: str) -> Path:
    """The record of ``spec`` (resolved) with these model files and this tokenizer."""
    from kvbatch.engine.runtime.engine_config import NUMERICS_VERSION
    from kvbatch.ops.decode.response_cache import KEY_VERSION, canonical_json
    from kvbatch.ops.fingerprint import model_stamp

    doc = {"record_version": RECORD_VERSION, "key_version": KEY_VERSION, "numerics_version": NUMERICS_VERSION,
           "spec": spec.to_json(), "stamp": model_stamp(spec.model), "tokenizer": tokenizer_id}
    return identity_dir() / (hashlib.sha256(canonical_json(doc)).hexdigest()[:40] + ".json")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("engine_id"), str) and isinstance(
        record.get("max_model_len"), int)
    return record if ok else None


def _write(path: Path, record: dict[str, Any]) -> None:
    """Written whole (a reader sees no record or all of it); a read-only cache folder costs one
    more engine build next time, nothing else."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass


class LazyEngine:
    """Stands for an ``LLM`` until something needs the engine itself: then ``build()`` runs once
    and every other attribute is the built engine's. Known without it: ``engine_id`` (the
    response cache's engine identity), ``tokenizer``, ``max_model_len``, ``engine_config``,
    ``spec`` (its ``config`` only, before the build), ``stats`` (zeros before the build) and
    ``connector`` (None before the build: nothing was loaded from a store)."""

    def __init__(self, build: Callable[[], LLM], *, engine_id: str, tokenizer: Any, max_model_len: int,
                 engine_config: Any, spec_config: Any = None, record: Path | None = None) -> None:
        self._build = build
        self._llm: LLM | None = None
        self._spec_config = spec_config
        self._record = record
        self.engine_id = engine_id
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.engine_config = engine_config

    @classmethod
    def open(cls, spec: EngineSpec, build: Callable[[], LLM]) -> LazyEngine:
        """The engine of ``spec`` (``build()`` builds it, e.g. ``ops.engine_build.build_llm``): not
        built yet where this machine has recorded its identity, built now (and recorded) where not."""
        from kvbatch.engine.models.weights import ModelLoadError
        from kvbatch.engine.text.tokenizer import ChatTokenizer
        from kvbatch.ops.decode.response_cache import engine_identity, tokenizer_identity
        from kvbatch.ops.engine_build import resolved

        spec = resolved(spec)
        try:
            tokenizer = ChatTokenizer.from_model(spec.model)
        except ModelLoadError:  # a checkpoint without a tokenizer: the engine says so itself
            tokenizer = None
        path = record_path(spec, tokenizer_identity(tokenizer))
        record = _read(path)
        if record is None:
            llm = build()
            engine = cls(build, engine_id=engine_identity(llm), tokenizer=llm.tokenizer,
                         max_model_len=llm.max_model_len, engine_config=llm.engine_config,
                         spec_config=spec.spec_config(), record=path)
            engine._llm = llm
            _write(path, {"engine_id": engine.engine_id, "max_model_len": llm.max_model_len,
                          "model": spec.model})
            return engine
        return cls(build, engine_id=record["engine_id"], tokenizer=tokenizer, max_model_len=record["max_model_len"],
                   engine_config=spec.engine_config(), spec_config=spec.spec_config(), record=path)

    @property
    def built(self) -> bool:
        return self._llm is not None

    def get(self) -> LLM:
        """The engine, built at the first call; its identity must be the one the run keyed with."""
        if self._llm is None:
            from kvbatch.ops.decode.response_cache import engine_identity

            llm = self._build()
            got = engine_identity(llm)
            if got != self.engine_id:
                if self._record is not None:
                    self._record.unlink(missing_ok=True)
                raise EngineIdentityChanged(
                    f"the engine built now has identity {got[:16]}, but this run keyed its response cache with "
                    f"{self.engine_id[:16]} from the record {self._record}; the record was removed: run again")
            self._llm = llm
        return self._llm

    @property
    def stats(self) -> dict[str, Any]:
        return self._llm.stats if self._llm is not None else dict(_UNBUILT_STATS)

    @property
    def spec(self) -> Any:
        if self._llm is not None:
            return self._llm.spec
        return None if self._spec_config is None else SimpleNamespace(config=self._spec_config)

    @property
    def connector(self) -> Any:
        return self._llm.connector if self._llm is not None else None

    def stream(self, requests: Iterable[Any], max_waiting: int | None = None) -> Iterator[Any]:
        """:meth:`LLM.stream`, the engine built at the first request: the ticks (Nones) before it
        come back as they are, so a run whose every row is a hit never builds it."""
        it = iter(requests)
        for request in it:
            if request is None:
                yield None
                continue
            yield from self.get().stream(itertools.chain([request], it), max_waiting)
            return

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never build for a private name (copying, pickling probes)
            raise AttributeError(name)
        return getattr(self.get(), name)


def engine_started(llm: Any) -> bool:
    """Whether ``llm`` is an engine that exists (any ``LLM``, or a :class:`LazyEngine` once built)."""
    return llm.built if isinstance(llm, LazyEngine) else True
