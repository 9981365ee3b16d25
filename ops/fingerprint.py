"""A model's identity (weights fingerprint, context window) computed once and kept, so steps
that only tokenize never load or hash weights.

The fingerprint of :func:`kvbatch.engine.models.weights.load_checkpoint` hashes every weight
byte (seconds for a small model, minutes for a large one). It is computed once per model, by
the first process that loads the weights anyway (:func:`remember`) or, failing that, by
:func:`model_identity` itself, and kept as a small JSON record in the fingerprint cache
(``$KVBATCH_CACHE_DIR`` or ``~/.cache/kvbatch``, ``fingerprints/<sha256 of the location>.json``).

A record is trusted only while the model's files are unchanged, checked cheaply: the *stamp*
of every file the fingerprint covers is its name, size, modification time and a sha256 of its
header (a safetensors header names every tensor's dtype, shape and offsets; a GGUF file's first
MiB holds its metadata and tensor table). A file rewritten in place with the same size, mtime
and header would fool the stamp; anything else (a new download, a re-quantization, a changed
config.json) recomputes the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import fsspec

from kvbatch.kernels.cpu.machine import CACHE_DIR_ENV, default_cache_dir  # torch-free

FINGERPRINT_CACHE_ENV = CACHE_DIR_ENV
RECORD_VERSION = 1
GGUF_HEADER_BYTES = 1 << 20
# Safetensors headers are JSON of at most a few MB; one larger than this is not a safetensors file.
MAX_SAFETENSORS_HEADER = 100 << 20


@dataclass(frozen=True)
class ModelIdentity:
    """What tokenizing steps need to know of a model without its weights."""

    fingerprint: str  # Checkpoint.fingerprint of load_checkpoint(model) (fp32 load)
    max_position_embeddings: int


def cache_dir() -> Path:
    return default_cache_dir() / "fingerprints"  # the one cache folder every kept measurement uses


def _record_path(source: str) -> Path:
    return cache_dir() / (hashlib.sha256(source.encode()).hexdigest()[:32] + ".json")


def _header_hash(fs: fsspec.AbstractFileSystem, path: str, size: int) -> str:
    with fs.open(path, "rb") as f:
        if path.endswith(".safetensors"):
            raw = f.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (0,)
            header = raw + f.read(min(n, MAX_SAFETENSORS_HEADER))
        else:  # gguf, config.json: the head (all of a small file)
            header = f.read(min(size, GGUF_HEADER_BYTES))
    return hashlib.sha256(header).hexdigest()


def _mtime(info: dict[str, Any]) -> str:
    for key in ("mtime", "LastModified", "last_modified", "updated", "ETag", "etag", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def model_stamp(model: str) -> list[list[Any]]:
    """[name, size, mtime, header sha256] of every file the fingerprint covers (the weights and
    config.json of an HF folder, or the GGUF file), sorted by name."""
    from kvbatch.engine.models.weights import resolve_model

    source = resolve_model(model)
    fs, path = fsspec.core.url_to_fs(source)
    if fs.isfile(path):
        files = [path]
    else:
        files = sorted(p for p in fs.ls(path, detail=False)
                       if p.endswith((".safetensors", ".gguf")) or p.rsplit("/", 1)[-1] == "config.json")
    stamp = []
    for p in files:
        info = fs.info(p)
        size = int(info.get("size") or 0)
        stamp.append([p.rsplit("/", 1)[-1], size, _mtime(info), _header_hash(fs, p, size)])
    return stamp


def cached_identity(model: str) -> ModelIdentity | None:
    """The kept identity of ``model`` if its files still match the stamp it was kept with."""
    from kvbatch.engine.models.weights import resolve_model

    path = _record_path(resolve_model(model))
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if record.get("version") != RECORD_VERSION or record.get("stamp") != model_stamp(model):
        return None
    return ModelIdentity(record["fingerprint"], int(record["max_position_embeddings"]))


def remember(model: str, identity: ModelIdentity) -> None:
    """Keep ``identity`` for ``model`` (written whole: a reader sees the old record or the new)."""
    from kvbatch.engine.models.weights import resolve_model

    path = _record_path(resolve_model(model))
    record = {"version": RECORD_VERSION, "model": resolve_model(model), "stamp": model_stamp(model),
              **asdict(identity)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:  # a read-only cache costs one more hash next time, nothing else
        pass


def identity_of_checkpoint(checkpoint: Any) -> ModelIdentity:
    """The identity of a loaded checkpoint (the context window as the engine reads it)."""
    from kvbatch.engine.models.config import ModelConfig

    return ModelIdentity(checkpoint.fingerprint, ModelConfig.from_hf(checkpoint.config).max_position_embeddings)


def model_identity(model: str) -> ModelIdentity:
    """The identity of ``model``: from the cache when its stamp matches, else computed by loading
    the checkpoint once (the one time its weights are hashed) and kept."""
    identity = cached_identity(model)
    if identity is None:
        from kvbatch.engine.models.weights import load_checkpoint

        identity = identity_of_checkpoint(load_checkpoint(model))
        remember(model, identity)
    return identity
