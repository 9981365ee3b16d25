"""The ``kvbatch`` command line.

Exit status: 0 when every request succeeded, 1 when the batch ran but some rows were rejected
(see the output's error lines or ``--errors``), 2 when the run could not start (a missing or
corrupt model, an unreadable input): those fail at once with a one-line message.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_OK, EXIT_REJECTS, EXIT_FATAL = 0, 1, 2


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="Hugging Face folder (local or fsspec URL), a .gguf file, or 'smollm2-135m' (default)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights, activations and KV cache")
    p.add_argument("--max-batch", type=int, default=64, help="most sequences decoded together")
    p.add_argument("--max-step-tokens", type=int, default=2048, help="token budget of one engine step")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory for the paged KV cache")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbatch", description="Batch LLM inference with a reusable KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run an OpenAI Batch JSONL file through a model")
    _engine_args(g)
    g.add_argument("--input", required=True, help="request JSONL (OpenAI Batch format), local path or fsspec URL")
    g.add_argument("--output", required=True, help="result JSONL, one line per request in input order")
    g.add_argument("--errors", default=None, help="also write the rejected rows here")
    g.add_argument("--metrics", default=None, help="write run metrics (JSON) here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("sample-data", help="write a generated sample request file (shared system prompts)")
    d.add_argument("--output", required=True, help="JSONL file to write (local path or fsspec URL)")
    d.add_argument("--requests", type=int, default=200)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--max-tokens", type=int, default=48)
    d.set_defaults(func=cmd_sample_data)
    return parser


def _fail(msg: str) -> int:
    print(f"kvbatch: error: {msg}", file=sys.stderr)
    return EXIT_FATAL


def _load_llm(args: argparse.Namespace) -> Any:
    from kvbatch.engine.config import EngineConfig
    from kvbatch.engine.llm import LLM

    cfg = EngineConfig(max_num_seqs=args.max_batch, max_num_batched_tokens=args.max_step_tokens,
                       kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)))
    return LLM(args.model, dtype=args.dtype, engine_config=cfg, seed=args.seed, num_threads=args.threads)


def _write_json(url: str, obj: dict) -> None:
    import fsspec

    with fsspec.open(url, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvbatch.engine.config import UnsupportedModelError
    from kvbatch.engine.weights import ModelLoadError
    from kvbatch.ops.batch_generate import run_batch

    try:
        llm = _load_llm(args)
    except (ModelLoadError, UnsupportedModelError) as exc:
        return _fail(str(exc))
    bar = tqdm(desc="requests", unit="req", disable=args.no_progress, file=sys.stderr)

    def progress(done: int, rejected: int) -> None:
        bar.update(done - bar.n)
        if rejected:
            bar.set_postfix(rejected=rejected, refresh=False)

    try:
        report = run_batch(llm, args.input, args.output, errors_url=args.errors,
                           model_name=args.model, on_progress=progress)
    except (FileNotFoundError, PermissionError) as exc:
        return _fail(f"cannot read {args.input}: {exc}")
    finally:
        bar.close()
    metrics = report.to_json()
    if args.metrics:
        _write_json(args.metrics, metrics)
    print(f"{report.succeeded} succeeded, {report.rejected} rejected; "
          f"{report.output_tokens} output tokens in {report.wall_s:.1f} s "
          f"({metrics['output_tokens_per_s']} tok/s) -> {args.output}", file=sys.stderr)
    return EXIT_REJECTS if report.rejected else EXIT_OK


def cmd_sample_data(args: argparse.Namespace) -> int:
    from kvbatch.ops.sample_dataset import write_sample_dataset

    if args.requests < 1:
        return _fail(f"--requests must be >= 1, got {args.requests}")
    n = write_sample_dataset(args.output, args.requests, args.seed, args.max_tokens)
    print(f"wrote {n} requests -> {args.output}", file=sys.stderr)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def entry() -> None:
    """Console-script entry point: exit with :func:`main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
