"""Decode one shard in a separate process: the entry point Dagster Pipes launches.

    python -m kvbatch.ops.decode_worker --spec spec.json      (standalone)
    launched by PipesSubprocessClient                          (the spec comes as the Pipes extra "spec")

The spec: ``{"model", "dtype", "engine": {EngineConfig fields}, "seed", "threads", "kv_store":
{KVStoreConfig fields}, "kv_fingerprint", "manifests_url", "results_url", "stats_url",
"storage_options"}``. ``dagster_pipes`` is imported only when ``DAGSTER_PIPES_CONTEXT`` is set,
so this module runs without Dagster installed; it reports the decode stats as the asset's
materialization metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

REPORTED = ("requests", "succeeded", "prompt_tokens", "loaded_prompt_tokens", "output_tokens", "wall_s",
            "output_tokens_per_s", "ttft_s_p50", "tpot_s_p50", "results_bytes")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from kvbatch.engine.config import EngineConfig
    from kvbatch.engine.llm import LLM
    from kvbatch.io.kv_store import KVStore, KVStoreConfig
    from kvbatch.ops.results import decode_shard

    store = KVStore.from_config(KVStoreConfig(**spec["kv_store"]), spec["kv_fingerprint"])
    llm = LLM(spec["model"], dtype=spec.get("dtype", "fp32"), engine_config=EngineConfig(**spec.get("engine", {})),
              kv_store=store, seed=spec.get("seed", 0), num_threads=spec.get("threads"))
    return decode_shard(llm, spec["manifests_url"], spec["results_url"], stats_url=spec.get("stats_url"),
                        storage_options=spec.get("storage_options") or {})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbatch.ops.decode_worker")
    p.add_argument("--spec", default=None, help="spec JSON file (not needed under Dagster Pipes)")
    args = p.parse_args(argv)
    if os.environ.get("DAGSTER_PIPES_CONTEXT"):
        from dagster_pipes import open_dagster_pipes  # lazy: only when launched by Dagster

        with open_dagster_pipes() as pipes:
            spec = pipes.get_extra("spec")
            pipes.log.info(f"decoding {spec['manifests_url']}")
            stats = run(spec)
            pipes.report_asset_materialization(
                metadata={k: (0.0 if stats.get(k) is None else stats[k]) for k in REPORTED})
        return 0
    if not args.spec:
        p.error("--spec is required outside Dagster Pipes")
    with open(args.spec, encoding="utf-8") as f:
        stats = run(json.load(f))
    print(json.dumps(stats, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
