"""How long a deployment of many declared pipelines takes to load.

Writes a temporary dg project whose ``defs/`` declares ``--pipelines`` pipelines (one
``defs.yaml`` of ``type: kvbatch.BatchInference`` each), then times, in this process,
``dagster.load_from_defs_folder`` (import, YAML, attribute validation, every pipeline's assets,
checks, jobs, schedule and sensors) and ``Definitions.validate_loadable`` (what a code server
does before serving them). Target: under 10 s for 50 pipelines.

    python -m benchmarks.bench_components [--pipelines 50]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path


def write_project(root: Path, pipelines: int) -> str:
    """A dg project with ``pipelines`` declared pipelines under ``root``; its module name."""
    module = f"bench_{uuid.uuid4().hex[:8]}"
    (root / "pyproject.toml").write_text(f'[tool.dg]\ndirectory_type = "project"\n\n[tool.dg.project]\n'
                                         f'root_module = "{module}"\ndefs_module = "{module}.defs"\n')
    defs = root / module / "defs"
    defs.mkdir(parents=True)
    (root / module / "__init__.py").write_text("")
    (defs / "__init__.py").write_text("")
    for i in range(pipelines):
        folder = defs / f"p{i:03d}"
        folder.mkdir()
        # Every other pipeline has its own KV store and SLO, so both resource paths are loaded.
        extra = f"  store: /kv/p{i:03d}\n  slo: {{ttft_s_p95_max: 5}}\n" if i % 2 else ""
        (folder / "defs.yaml").write_text(
            "type: kvbatch.BatchInference\nattributes:\n"
            f"  name: p{i:03d}\n  model: smollm2-135m\n  input: s3://bucket/p{i:03d}/{{date}}.jsonl\n"
            f"  schedule: \"{i % 60} 2 * * *\"\n  shards: {1000 + i}\n{extra}")
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, default=50)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    import dagster as dg

    import kvbatch.pipelines.component  # noqa: F401  (the import, timed apart from the load)
    from kvbatch.kernels.cpu.machine import cpu_identity

    imported = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="bench-components-") as tmp:
        root = Path(tmp)
        write_project(root, args.pipelines)
        sys.path.insert(0, str(root))
        t1 = time.perf_counter()
        defs = dg.load_from_defs_folder(path_within_project=root)
        loaded = time.perf_counter() - t1
        t2 = time.perf_counter()
        dg.Definitions.validate_loadable(defs)
        validated = time.perf_counter() - t2
        assets = len(defs.resolve_asset_graph().get_all_asset_keys())
        jobs, schedules = len(defs.jobs or []), len(defs.schedules or [])
    cpu, _ = cpu_identity()
    total = loaded + validated
    print(f"{args.pipelines} declared pipelines: {assets} assets, {jobs} jobs, {schedules} schedules")
    print(f"import kvbatch.pipelines.component (dagster included): {imported:.2f} s")
    print(f"load_from_defs_folder: {loaded:.2f} s; validate_loadable: {validated:.2f} s; "
          f"load + validate: {total:.2f} s (target < 10 s)")
    print(f"CPU: {cpu}")
    return 0 if total < 10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
