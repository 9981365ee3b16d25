"""The ``--workers`` group resumes: a re-run of the same command keeps the rows an earlier,
killed run committed, and answers only the rest.

The ranks' part files (:mod:`kvbatch.ops.decode.checkpoint`, one row per output line, under its
place in the whole input) live in a dot folder beside the output, which a SIGKILL does not
remove. The folder's ``key.json`` says what its rows answer (:func:`group_key`): the input file
(path, size, modification time; the ETag or generation on an object store), the model's weights
fingerprint and name, and the options that change an answer (dtype, weights, device kind,
deterministic numerics, default seed, strict reading, speculative decoding). Before any rank
writes, rank 0 keeps the folder when its key is this run's (a resume) and otherwise deletes it,
saying on stderr which of those differ (:func:`start_group_parts`): rows of another input or
options are never mixed into an output. Discarding rather than refusing: the run is about to
replace that output anyway, and the parts can only answer the command the user has changed.

The key holds neither the world size nor the batching options: a part row is keyed by its
place in the input, so a re-run with another ``--workers`` or ``--max-batch`` resumes too
(without ``--deterministic`` a greedy token may differ with other batching, as it may between
two uninterrupted runs; unseeded sampled rows differ between any two runs).
"""

from __future__ import annotations

import collections
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import fsspec
import numpy as np

from kvbatch.engine.spec import EngineSpec
from kvbatch.io.urls import redact
from kvbatch.ops.decode.checkpoint import parts_count, parts_key, remove_parts

GROUP_PARTS_FORMAT = 2  # bump when GROUP_PART_SCHEMA or a line's encoding changes: older parts are discarded

# Key field -> the option a user changes to change it (named in the discard message).
_KEY_FLAGS = {
    "format": "parts format (kvbatch version)", "command": "command", "input": "input file",
    "model": "model weights", "model_name": "--model", "dtype": "--dtype", "weights": "--weights",
    "device": "--device", "deterministic": "--deterministic", "seed": "--seed", "strict": "--strict",
    "speculative": "--spec",
}


def file_identity(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Which bytes ``url`` holds, cheaply: a local file's real path, size and modification time
    (nanoseconds), else the filesystem's own key (ETag / generation, size, modification time).
    A rewritten file has another identity even when its content is the same (safe side)."""
    fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    if "file" in fs.protocol:
        st = os.stat(path)
        return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"path": path, "ukey": fs.ukey(path)}  # path without scheme: user-info credentials never in it


def group_key(spec: Mapping[str, Any], model_fingerprint: str) -> str:
    """What a worker group's rows answer (module docstring), as canonical JSON."""
    engine = EngineSpec.from_json(spec["engine_spec"])
    source = spec["input"] if spec["command"] == "generate" else spec["manifests"]
    doc = {
        "format": GROUP_PARTS_FORMAT, "command": spec["command"],
        "input": file_identity(source, spec.get("storage_options")),
        "model": model_fingerprint, "model_name": spec.get("model_name", "kvbatch"),
        "dtype": engine.dtype, "weights": engine.weights,
        "device": "cuda" if engine.device.startswith("cuda") else "cpu",
        "deterministic": engine.deterministic, "seed": engine.seed,
        "strict": bool(spec.get("strict", False)),
        "speculative": {"method": engine.speculative, "max_len": engine.spec_max_len,
                        "adaptive": engine.spec_adaptive} if engine.speculative else None,
    }
    return json.dumps(doc, sort_keys=True)


def key_difference(old: str | None, new: str) -> list[str]:
    """The options (as a user names them) in which key ``old`` differs from ``new``."""
    try:
        before = json.loads(old) if old else None
    except json.JSONDecodeError:
        before = None
    if not isinstance(before, dict):  # no key, or one written before keys were documents
        return [_KEY_FLAGS["format"]]
    after = json.loads(new)
    order = list(_KEY_FLAGS)
    fields = sorted(set(before) | set(after), key=lambda k: (order.index(k) if k in order else len(order), k))
    return [_KEY_FLAGS.get(k, k) for k in fields if before.get(k) != after.get(k)]


def start_group_parts(parts_url: str, key: str, storage_options: Mapping[str, Any] | None, *, resume: bool,
                      say: Callable[[str], None] | None = None) -> int:
    """Rank 0, before any rank writes: keep the parts an earlier run of this same command left
    (``resume``), or delete them, saying why. Returns the rows kept."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    where = redact(parts_url)
    parts, rows = parts_count(parts_url, storage_options)
    if parts == 0:
        remove_parts(parts_url, storage_options)  # a key.json alone, or temp files of a killed write
        return 0
    found = parts_key(parts_url, storage_options)
    if resume and found == key:
        say(f"kvbatch: resuming: {rows} rows answered by an earlier run ({parts} parts in {where}) are kept; "
            f"answering the rest")
        return rows
    why = "--no-resume" if found == key else "made with a different " + ", ".join(key_difference(found, key))
    say(f"kvbatch: discarding {rows} rows an earlier run left ({parts} parts in {where}): {why}; "
        f"answering every row")
    remove_parts(parts_url, storage_options)
    return 0


def unanswered(items: Iterable[Any], rank: int, world: int, done: np.ndarray,
               skipped: list[int]) -> Iterator[tuple[int, Any]]:
    """This rank's rows (input row ``i`` when ``i % world == rank``), each with its place in the
    rank's share, less those whose input row is in ``done`` (sorted; :func:`done_index_array`),
    counted in ``skipped[0]``. Rows come in input order, so one pointer walks ``done``."""
    j = 0
    for local, item in enumerate(item for i, item in enumerate(items) if i % world == rank):
        row = local * world + rank
        while j < len(done) and int(done[j]) < row:
            j += 1
        if j < len(done) and int(done[j]) == row:
            skipped[0] += 1
            continue
        yield local, item


def with_indexes(build: Callable[[Iterable[Any]], Iterator[Any]], pairs: Iterable[tuple[int, Any]]) -> Iterator[Any]:
    """``build`` (one job per item, lazily: ``tokenize_requests``, ``manifest_jobs``) over the
    items of ``pairs``, each job numbered by its pair's place in the rank's share, so the rows
    skipped leave gaps where they belong."""
    places: collections.deque[int] = collections.deque()

    def items() -> Iterator[Any]:
        for place, item in pairs:
            places.append(place)
            yield item

    for job in build(items()):
        job.index = places.popleft()
        yield job
