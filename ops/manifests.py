"""The hand-off from prefill to decode: one manifest line per input row, in input order.

Written by prefill (``kvbatch prefill``, the pipeline's ``prefill_kv``) and read by decode in
another process or machine (``kvbatch decode``, ``decode_results``, the decode worker group).
The line names the model, KV layout and block keys the prompt's KV was stored under, so decode
refuses manifests made for another model (:class:`ManifestMismatch`) instead of loading wrong KV.

Manifest line (JSONL), one per input row, in input order:
``{"index", "custom_id", "line_no", "model", "fingerprint", "kv_root", "block_size", "dtype",
"prompt_token_ids", "block_keys", "sampling", "request_model"}`` or, for a rejected row,
``{"index", "custom_id", "line_no", "rejected": {"field", "reason"}}``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import fsspec
from kvbatch.engine.runtime.llm import LLM
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.io.batch_requests import RejectedRow
from kvbatch.ops.jobs import Job, Rejected

MANIFEST_VERSION = 1


class ManifestMismatch(ValueError):
    """The manifests were made for another model, dtype or block size than the decoder's."""


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
    }


def read_manifests(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    with fsspec.open(url, "rt", encoding="utf-8", **(storage_options or {})) as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{url}: manifest line {line_no} is not JSON ({exc.msg})") from None


def manifest_jobs(llm: LLM, manifests: Iterator[dict[str, Any]]) -> Iterator[Job | Rejected]:
    """Turn manifests into engine jobs; refuse at the first manifest made for another model."""
    want = identity(llm)
    for m in manifests:
        if "rejected" in m:
            r = m["rejected"]
            yield Rejected(m["index"], RejectedRow(m["line_no"], m.get("custom_id"), r["field"], r["reason"]))
            continue
        got = {k: m.get(k) for k in want}
        if got != want:
            diff = ", ".join(f"{k}: manifest {got[k]!r} vs decoder {want[k]!r}" for k in want if got[k] != want[k])
            raise ManifestMismatch(f"manifest for {m.get('custom_id')!r} was made for another model or layout ({diff})")
        sp = dict(m["sampling"])
        sp["stop"] = tuple(sp.get("stop") or ())
        sp["stop_token_ids"] = tuple(sp.get("stop_token_ids") or ())
        yield Job(m["index"], m["custom_id"], m["line_no"], list(m["prompt_token_ids"]), SamplingParams(**sp),
                  m.get("request_model"))

