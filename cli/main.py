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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="Hugging Face folder (local or fsspec URL), a .gguf file, or 'smollm2-135m' (default)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights, activations and KV cache")
    p.add_argument("--max-batch", type=_positive_int, default=64, help="most sequences decoded together")
    p.add_argument("--max-step-tokens", type=_positive_int, default=2048, help="token budget of one engine step")
    p.add_argument("--kv-cache-gb", type=_positive_float, default=1.0, help="memory for the paged KV cache")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics: a request's tokens are bitwise independent of its batch, "
                        "chunking and KV source (slower at small batches)")


def _spec_method(text: str) -> str:
    from kvbatch.engine.speculative.controller import SpecConfig

    try:
        SpecConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default=None, metavar="METHOD", type=_spec_method,
                   help="speculative decoding: ngram (prompt lookup), draft:MODEL (a smaller model with the "
                        "same tokenizer) or early-exit:K (the model's first K layers draft)")
    p.add_argument("--spec-max-len", type=_positive_int, default=8, help="most tokens drafted per step")
    p.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="adapt the draft length per request from its observed acceptance and stop "
                        "drafting when a draft is unlikely to be kept (default on)")


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=_positive_int, default=1,
                   help="ranks of a local worker group (torch.distributed, gloo): requests split over them, "
                        "a MoE model's experts too (expert parallel)")
    p.add_argument("--eplb-interval", type=int, default=0, metavar="STEPS",
                   help="with --workers > 1 on a MoE model: rebalance the experts over the ranks every STEPS "
                        "steps from the observed loads (0: never)")
    p.add_argument("--redundant-experts", type=int, default=0, metavar="R",
                   help="extra expert slots for replicas of hot experts (experts + R must divide by --workers)")


def _store_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--store", required=required, default=None,
                   help="KV store URL (s3://bucket/prefix, file:///path, or a local folder)")
    p.add_argument("--store-memory-gb", type=float, default=2.0, help="in-process memory tier of the KV store")
    p.add_argument("--store-disk", default=None, help="local disk tier folder of the KV store")
    p.add_argument("--store-disk-gb", type=float, default=20.0)


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
    _store_args(g, required=False)
    _spec_args(g)
    _worker_args(g)
    g.set_defaults(func=cmd_generate)

    pf = sub.add_parser("prefill", help="compute and store the prompts' KV; write decode manifests")
    _engine_args(pf)
    _store_args(pf, required=True)
    pf.add_argument("--input", required=True, help="request JSONL (OpenAI Batch format)")
    pf.add_argument("--manifests", required=True, help="manifest JSONL to write (one line per input row)")
    pf.add_argument("--metrics", default=None, help="write prefill metrics (JSON) here")
    pf.add_argument("--no-progress", action="store_true")
    pf.set_defaults(func=cmd_prefill)

    dc = sub.add_parser("decode", help="generate from manifests, loading the stored prompt KV")
    _engine_args(dc)
    _store_args(dc, required=True)
    dc.add_argument("--manifests", required=True, help="manifests written by `kvbatch prefill`")
    dc.add_argument("--output", required=True, help="result JSONL, one line per request in input order")
    dc.add_argument("--errors", default=None, help="also write the rejected rows here")
    dc.add_argument("--metrics", default=None, help="write run metrics (JSON) here")
    dc.add_argument("--no-progress", action="store_true")
    _spec_args(dc)
    _worker_args(dc)
    dc.set_defaults(func=cmd_decode)

    kv = sub.add_parser("kv", help="inspect or clean a KV store")
    kv_sub = kv.add_subparsers(dest="kv_command", required=True)
    st = kv_sub.add_parser("stats", help="blocks, bytes and packs per model in a store")
    st.add_argument("--store", required=True)
    st.set_defaults(func=cmd_kv_stats)
    gc = kv_sub.add_parser("gc", help="delete expired or excess packs from a store")
    gc.add_argument("--store", required=True)
    gc.add_argument("--ttl-hours", type=float, default=None, help="delete packs older than this")
    gc.add_argument("--max-gb", type=float, default=None, help="delete oldest packs beyond this size")
    gc.set_defaults(func=cmd_kv_gc)

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
    from kvbatch.engine.models.weights import load_checkpoint
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM
    from kvbatch.engine.speculative.controller import SpecConfig
    from kvbatch.io.kv_store import KVStore, KVStoreConfig

    cfg = EngineConfig(max_num_seqs=args.max_batch, max_num_batched_tokens=args.max_step_tokens,
                       kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)), batch_invariant=args.deterministic)
    ckpt = load_checkpoint(args.model)
    store = None
    if getattr(args, "store", None):
        store_cfg = KVStoreConfig(url=args.store, memory_bytes=int(args.store_memory_gb * (1 << 30)),
                                  disk_dir=args.store_disk, disk_bytes=int(args.store_disk_gb * (1 << 30)))
        # The store checks every block against the fingerprint of the exact KV layout.
        store = KVStore.from_config(store_cfg, _kv_fingerprint(ckpt.fingerprint, args.dtype, cfg.block_size))
    spec = None
    if getattr(args, "spec", None):
        spec = SpecConfig.parse(args.spec, args.spec_max_len, args.spec_adaptive)
    return LLM(ckpt, dtype=args.dtype, engine_config=cfg, kv_store=store, seed=args.seed,
               num_threads=args.threads, speculative=spec)


def _kv_fingerprint(model_fingerprint: str, dtype: str, block_size: int) -> str:
    from kvbatch.ops.shards import kv_fingerprint

    return kv_fingerprint(model_fingerprint, dtype, block_size)


def _write_json(url: str, obj: dict) -> None:
    import fsspec

    with fsspec.open(url, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def cmd_generate(args: argparse.Namespace) -> int:
    from kvbatch.ops.batch_generate import run_batch

    if args.workers > 1:
        return _run_worker_group(args, "generate")
    try:
        llm = _load_llm(args)
    except Exception as exc:  # noqa: BLE001 - any load failure is fatal, reported in one line
        return _fail(_load_error(exc))
    bar = _progress_bar(args, "requests")

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
    _add_store_metrics(llm, metrics)
    if args.metrics:
        _write_json(args.metrics, metrics)
    print(f"{report.succeeded} succeeded, {report.rejected} rejected; "
          f"{report.output_tokens} output tokens in {report.wall_s:.1f} s "
          f"({metrics['output_tokens_per_s']} tok/s) -> {args.output}", file=sys.stderr)
    return EXIT_REJECTS if report.rejected else EXIT_OK


def _run_worker_group(args: argparse.Namespace, command: str) -> int:
    """``--workers W``: start W local ranks of the worker-group entry point (the one torchrun
    runs) and wait; rank 0 writes the output and the metrics."""
    import os
    import tempfile

    from kvbatch.ops.worker_group import launch_local

    if args.eplb_interval < 0 or args.redundant_experts < 0:
        return _fail("--eplb-interval and --redundant-experts must be >= 0")
    spec: dict[str, Any] = {
        "command": command, "model": args.model, "dtype": args.dtype, "seed": args.seed, "threads": args.threads,
        "engine": {"max_num_seqs": args.max_batch, "max_num_batched_tokens": args.max_step_tokens,
                   "kv_cache_bytes": int(args.kv_cache_gb * (1 << 30)), "batch_invariant": args.deterministic},
        "output": args.output, "errors": args.errors, "metrics": args.metrics, "model_name": args.model,
        "eplb_interval": args.eplb_interval, "redundant_experts": args.redundant_experts,
    }
    if command == "generate":
        spec["input"] = args.input
    else:
        spec["manifests"] = args.manifests
    if getattr(args, "store", None):
        spec["kv_store"] = {"url": args.store, "memory_bytes": int(args.store_memory_gb * (1 << 30)),
                            "disk_dir": args.store_disk, "disk_bytes": int(args.store_disk_gb * (1 << 30))}
    if getattr(args, "spec", None):
        spec["speculative"] = {"method": args.spec, "max_len": args.spec_max_len, "adaptive": args.spec_adaptive}
    with tempfile.TemporaryDirectory(prefix="kvbatch-workers-") as tmp:
        spec["report"] = os.path.join(tmp, "report.json")
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        code = launch_local(args.workers, ["--spec", spec_path])
        if code not in (EXIT_OK, EXIT_REJECTS) or not os.path.exists(spec["report"]):
            return code if code not in (EXIT_OK, EXIT_REJECTS) else EXIT_FATAL
        with open(spec["report"], encoding="utf-8") as f:
            m = json.load(f)
    ep = m.get("expert_parallel")
    ep_text = (f"; all-to-all {ep['a2a_bytes_per_token_per_layer']:.0f} B/token/layer, "
               f"{ep['rebalances']} rebalances" if ep else "")
    loaded = (f"; {m['loaded_prompt_tokens']} of {m['prompt_tokens']} prompt tokens loaded from the store"
              if command == "decode" else "")
    print(f"{m['succeeded']} succeeded, {m['rejected']} rejected{loaded}; {m['output_tokens']} output tokens in "
          f"{m['wall_s']:.1f} s on {args.workers} workers ({m['output_tokens_per_s']} tok/s){ep_text} "
          f"-> {args.output}", file=sys.stderr)
    return code


def _progress_bar(args: argparse.Namespace, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(desc=desc, unit="req", disable=args.no_progress, file=sys.stderr)


def _add_store_metrics(llm: Any, metrics: dict) -> None:
    if llm.connector is not None:
        metrics["kv_store"] = llm.connector.stats.to_json()
        metrics["kv_store"]["store"] = llm.connector.store.stats()


def cmd_prefill(args: argparse.Namespace) -> int:
    from kvbatch.ops.kv_handoff import run_prefill

    try:
        llm = _load_llm(args)
    except Exception as exc:  # noqa: BLE001 - any load failure is fatal, reported in one line
        return _fail(_load_error(exc))
    bar = _progress_bar(args, "prefill")
    try:
        report = run_prefill(llm, args.input, args.manifests, model_name=args.model,
                             on_progress=lambda n: bar.update(n - bar.n))
    except (FileNotFoundError, PermissionError) as exc:
        return _fail(f"cannot read {args.input}: {exc}")
    finally:
        bar.close()
    metrics = report.to_json()
    if args.metrics:
        _write_json(args.metrics, metrics)
    print(f"prefilled {report.requests - report.rejected} requests ({report.rejected} rejected): "
          f"{report.prompt_tokens_computed} of {report.prompt_tokens} prompt tokens computed, "
          f"{metrics.get('blocks_written', 0)} blocks written in {report.wall_s:.1f} s -> {args.manifests}",
          file=sys.stderr)
    return EXIT_REJECTS if report.rejected else EXIT_OK


def cmd_decode(args: argparse.Namespace) -> int:
    from kvbatch.ops.kv_handoff import run_decode
    from kvbatch.ops.manifests import ManifestMismatch

    if args.workers > 1:
        return _run_worker_group(args, "decode")
    try:
        llm = _load_llm(args)
    except Exception as exc:  # noqa: BLE001
        return _fail(_load_error(exc))
    bar = _progress_bar(args, "decode")
    try:
        report = run_decode(llm, args.manifests, args.output, errors_url=args.errors, model_name=args.model,
                            on_progress=lambda done, rej: bar.update(done - bar.n))
    except (FileNotFoundError, PermissionError) as exc:
        return _fail(f"cannot read {args.manifests}: {exc}")
    except (ManifestMismatch, ValueError) as exc:
        return _fail(str(exc))
    finally:
        bar.close()
    metrics = report.to_json()
    _add_store_metrics(llm, metrics)
    if args.metrics:
        _write_json(args.metrics, metrics)
    print(f"{report.succeeded} succeeded, {report.rejected} rejected; {report.loaded_prompt_tokens} of "
          f"{report.prompt_tokens} prompt tokens loaded from the store; {report.output_tokens} output tokens "
          f"in {report.wall_s:.1f} s -> {args.output}", file=sys.stderr)
    return EXIT_REJECTS if report.rejected else EXIT_OK


def cmd_kv_stats(args: argparse.Namespace) -> int:
    from kvbatch.io.kv_store import kv_stats

    print(json.dumps(kv_stats(args.store), indent=2, default=str))
    return EXIT_OK


def cmd_kv_gc(args: argparse.Namespace) -> int:
    from kvbatch.io.kv_store import kv_gc

    ttl = args.ttl_hours * 3600 if args.ttl_hours is not None else None
    max_bytes = int(args.max_gb * (1 << 30)) if args.max_gb is not None else None
    if ttl is None and max_bytes is None:
        return _fail("kv gc needs --ttl-hours and/or --max-gb")
    print(json.dumps(kv_gc(args.store, ttl, max_bytes), indent=2, default=str))
    return EXIT_OK


def _load_error(exc: Exception) -> str:
    from kvbatch.engine.models.errors import UnsupportedModelError
    from kvbatch.engine.models.weights import ModelLoadError

    if isinstance(exc, (ModelLoadError, UnsupportedModelError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


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
