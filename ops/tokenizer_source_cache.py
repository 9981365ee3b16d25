"""A GGUF model's tokenizer metadata read once and kept, so a tokenizing step does not parse the
GGUF file again in every process.

Reading the tokenizer out of a GGUF file goes through ``gguf``'s reader, which walks every
metadata field in Python: 4-10 s per process for SmolLM2's 49,152 tokens and merges on a
2-vCPU machine, more than tokenizing 100,000 prompts takes with the columnar shard path. The
metadata (``TokenizerSource.gguf_metadata``: tokens, merges, token types, special ids, chat
template) is kept as JSON beside the fingerprint records (``<cache>/tokenizers/``) and trusted
under the same stamp as the fingerprint (:func:`kvbatch.ops.fingerprint.model_stamp`: size,
mtime and header hash of the GGUF file). Hugging Face folders are not kept: their
``tokenizer.json`` is read directly, in milliseconds, and is not covered by the stamp.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kvbatch.engine.models.weights import TokenizerSource, load_tokenizer_source
from kvbatch.ops.fingerprint import cache_dir, model_stamp

RECORD_VERSION = 1


def _record_path(source: str) -> Path:
    return cache_dir().parent / "tokenizers" / (hashlib.sha256(source.encode()).hexdigest()[:32] + ".json")


def _plain(value: Any) -> Any:
    """JSON-ready: numpy scalars and arrays (what the GGUF reader may hand out) as Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def kept_tokenizer_source(model: str) -> TokenizerSource:
    """``load_tokenizer_source(model)``, from the kept record while the GGUF file is unchanged."""
    from kvbatch.engine.models.weights import resolve_model

    location = resolve_model(model)
    path = _record_path(location)
    stamp = None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = None
    if record is not None and record.get("version") == RECORD_VERSION:
        stamp = model_stamp(model)
        if record.get("stamp") == stamp:
            return TokenizerSource("gguf", record["source"], gguf_metadata=record["gguf_metadata"])
    src = load_tokenizer_source(model)
    if src.kind == "gguf":
        _keep(path, {"version": RECORD_VERSION, "model": location, "stamp": stamp or model_stamp(model),
                     "source": src.source, "gguf_metadata": {k: _plain(v) for k, v in src.gguf_metadata.items()}})
    return src


def _keep(path: Path, record: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)  # a reader sees the old record or the new, never half of one
    except OSError:  # a read-only cache costs one more read of the GGUF file next time
        pass
