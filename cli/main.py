"""The ``kvbatch`` command line.

Exit status: 0 when every request succeeded, 1 when the batch ran but some rows were rejected
(see the output's error lines or ``--errors``), 2 when the run could not start (a missing or
corrupt model, an unreadable input, an output that cannot be written): those fail at once with
a one-line message. ``generate`` (one process or ``--workers N``) and ``prefill`` open their
input and their outputs before they load the model, so those fail in seconds, not after the
load. 2 also when the input broke part-way (a truncated ``.gz``): every row read before the
break is answered in the output (prefill: prefilled and in the manifests), whose last line says
where the input ended. 130 / 143 after SIGINT / SIGTERM: one line, unfinished outputs discarded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

EXIT_OK, EXIT_REJECTS, EXIT_FATAL = 0, 1, 2
EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM


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
    from kvbatch.engine.runtime.engine_config import LINEAR_CHOICES  # (no torch: --help stays fast)

    p.add_argument("--model", default="smollm2-135m",
                   help="Hugging Face folder (local or fsspec URL), a .gguf file, or 'smollm2-135m' (default)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="weights, activations and KV cache (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help="auto (CUDA when present, the default), cpu, cuda or cuda:N")
    p.add_argument("--gpu-memory-utilization", type=_positive_float, default=0.9, metavar="FRACTION",
                   help="CUDA: share of the GPU's memory the engine may hold; the KV cache gets what the "
                        "weights and a warm-up pass leave of it (default 0.9)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--max-batch", type=_positive_int, default=64, help="most sequences decoded together")
    p.add_argument("--max-step-tokens", type=_positive_int, default=2048, help="token budget of one engine step")
    p.add_argument("--kv-cache-gb", type=_positive_float, default=1.0, help="memory for the paged KV cache")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics: a request's tokens are bitwise independent of its batch, "
                        "chunking and KV source (slower at small batches)")
    p.add_argument("--linear", choices=LINEAR_CHOICES, default="auto",
                   help="CPU projection kernel: auto (measured on this machine at load, cached in "
                        "~/.cache/kvbatch), or force oneDNN packed weights, BLAS, or MKL packed weights (fp32)")
    p.add_argument("--weights", choices=["full", "int8", "gguf"], default="full",
                   help="dense projection weights: full (the --dtype) or int8 (weight-only, per-channel "
                        "scales, CPU; quality delta in docs/performance.md)")


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
                        "same tokenizer), early-exit:K (the model's first K layers draft) or suffix:ANSWERS "
                        "(earlier runs' answers: an output JSONL or results Parquet, a file, glob or URL, "
                        "beside prompt lookup)")
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
    p.add_argument("--checkpoint-rows", type=_positive_int, default=256, metavar="N",
                   help="with --workers > 1: each rank commits its answers every N rows, so a killed run loses "
                        "at most N per rank (default 256)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="with --workers > 1: a re-run of the same command after a kill keeps the rows the killed "
                        "run committed and answers only the rest (default on; --no-resume answers every row)")


def _store_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--store", required=required, default=None,
                   help="KV store URL (s3://bucket/prefix, file:///path, or a local folder)")
    p.add_argument("--store-memory-gb", type=float, default=2.0, help="in-process memory tier of the KV store")
    p.add_argument("--store-disk", default=None, help="local disk tier folder of the KV store")
    p.add_argument("--store-disk-gb", type=float, default=20.0)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _response_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--response-cache", default=None, metavar="URI",
                   help="exact response cache across runs (a folder, file:// or s3:// URL): reproducible rows "
                        "(greedy, or seeded) already answered by the same engine are served from it, the rest "
                        "are written to it (docs/response-cache.md)")
    p.add_argument("--response-cache-verify", type=_fraction, default=0.0, metavar="FRACTION",
                   help="with --response-cache: recompute this share of the hits (a seeded sample) and fail, "
                        "naming the row, if one differs from its cached answer")


def _open_response_cache(args: argparse.Namespace, llm: Any, stack: contextlib.ExitStack) -> Any:
    """The ``--response-cache`` of ``args`` for ``llm``'s engine, closed (its writes waited for)
    on leaving; None without the option."""
    url = getattr(args, "response_cache", None)
    if not url:
        return None
    from kvbatch.ops.decode.response_cache import ResponseCache

    try:  # for_llm takes a LazyEngine too, without building it
        cache = ResponseCache.for_llm(url, llm, verify=args.response_cache_verify)
    except Exception as exc:  # noqa: BLE001 - an unusable cache URL is one line
        from kvbatch.io.urls import one_line, redact

        raise _CannotRun(f"cannot use the response cache at {redact(url)}: {one_line(exc, url)}") from None
    stack.callback(cache.close)
    return cache


def _response_cache_text(rc: dict[str, Any] | None) -> str:
    return (f"; response cache: {rc['hits']} hits, {rc['misses']} misses, {rc['writes']} writes"
            if rc is not None else "")


def _result_args(p: argparse.ArgumentParser) -> None:
    """The outputs of a run that answers requests (generate, decode)."""
    p.add_argument("--output", required=True, help="result JSONL, one line per request in input order")
    p.add_argument("--errors", default=None, help="also write the rejected rows here")
    p.add_argument("--metrics", default=None, help="write run metrics (JSON) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbatch", description="Batch LLM inference with a reusable KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run an OpenAI Batch JSONL file through a model")
    _engine_args(g)
    g.add_argument("--input", required=True, help="request JSONL (OpenAI Batch format), local path or fsspec URL")
    _result_args(g)
    g.add_argument("--strict", action="store_true",
                   help="reject rows with fields this reader does not know (such as a typo, max_token) instead of "
                        "ignoring them with a warning once per field name")
    _store_args(g, required=False)
    _spec_args(g)
    _worker_args(g)
    _response_cache_args(g)
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
    _result_args(dc)
    _spec_args(dc)
    _worker_args(dc)
    _response_cache_args(dc)
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
    gc.add_argument("--unused-days", type=float, default=None,
                    help="delete packs neither written nor read (by decode) for this many days")
    gc.add_argument("--rewrite-below", type=float, default=0.5,
                    help="with --unused-days: rewrite a segment whose used blocks hold less than this share of it")
    gc.add_argument("--rewrite-grace-hours", type=float, default=24.0,
                    help="a rewritten segment is deleted once its copy is this old (running decodes read it meanwhile)")
    gc.set_defaults(func=cmd_kv_gc)
    cp = kv_sub.add_parser("compact", help="fold the per-writer index files into a partitioned index (gc runs it too)")
    cp.add_argument("--store", required=True)
    cp.add_argument("--grace-hours", type=float, default=1.0,
                    help="index files this recent stay listed by readers; older generations kept this long")
    cp.set_defaults(func=cmd_kv_compact)
    from kvbatch.cli.response_cache_command import add_parser as add_response_cache_parser
    add_response_cache_parser(sub)  # kvbatch response-cache gc (its own module: this file is at its size limit)

    d = sub.add_parser("sample-data", help="write a generated sample request file (shared system prompts)")
    d.add_argument("--output", required=True, help="JSONL file to write (local path or fsspec URL)")
    d.add_argument("--requests", type=int, default=200)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--max-tokens", type=int, default=48)
    d.set_defaults(func=cmd_sample_data)

    sv = sub.add_parser("serve", help="serve OpenAI's Files and Batches API over the pipeline (docs/batch-api.md)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--insecure-no-auth", action="store_true",
                    help="serve without API keys (refused otherwise when KVBATCH_API_KEYS is empty)")
    sv.add_argument("--max-file-mb", type=_positive_int, default=200, help="largest upload (OpenAI's limit: 200)")
    sv.add_argument("--max-requests", type=_positive_int, default=50_000,
                    help="most requests in one batch (OpenAI's limit: 50,000)")
    sv.add_argument("--chunk-rows", type=_positive_int, default=256,
                    help="rows per committed part of a running batch: a restart re-runs at most this many")
    sv.set_defaults(func=cmd_serve)
    return parser


def _fail(msg: str) -> int:
    print(f"kvbatch: error: {msg}", file=sys.stderr)
    return EXIT_FATAL


def _engine_spec(args: argparse.Namespace) -> Any:
    """The engine the command's options ask for (device and dtype resolved by ``_resolve_device``)."""
    from kvbatch.engine.spec import EngineSpec

    return EngineSpec(
        model=args.model, dtype=args.dtype, device=args.device, weights=args.weights, linear=args.linear,
        deterministic=args.deterministic, max_batch=args.max_batch, max_step_tokens=args.max_step_tokens,
        kv_cache_gb=args.kv_cache_gb, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager, seed=args.seed, threads=args.threads,
        speculative=getattr(args, "spec", None), spec_max_len=getattr(args, "spec_max_len", 8),
        spec_adaptive=getattr(args, "spec_adaptive", True))


def _store_config(args: argparse.Namespace) -> Any:
    """The ``--store*`` options as a KV store config, or None without ``--store``."""
    if not getattr(args, "store", None):
        return None
    from kvbatch.io.kvstore.store import KVStoreConfig

    return KVStoreConfig(url=args.store, memory_bytes=int(args.store_memory_gb * (1 << 30)),
                         disk_dir=args.store_disk, disk_bytes=int(args.store_disk_gb * (1 << 30)))


def _load_llm(args: argparse.Namespace) -> Any:
    from kvbatch.ops.engine_build import build_llm

    # The store checks every block against the engine's KV fingerprint (the builder derives both).
    return build_llm(_engine_spec(args), _store_config(args))


class _SamePath(ValueError):
    """Two of a run's files are one path."""


def _check_distinct(args: argparse.Namespace, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
    """Two outputs at one path overwrite each other on commit; an output over the input
    replaces the requests with their answers. Both are refused before any work."""
    def key(url: str) -> str:
        return os.path.realpath(url.removeprefix("file://")) if "://" not in url or url.startswith("file://") else url

    seen: dict[str, str] = {}
    for flag in inputs + outputs:
        url = getattr(args, flag, None)
        if not url:
            continue
        other = seen.setdefault(key(url), flag)
        if other != flag:
            raise _SamePath(f"--{other} and --{flag} name the same path {url}")


class _CannotRun(Exception):
    """The run cannot start or finish: one ``kvbatch: error:`` line and exit 2, said by ``main``
    once the command's ``with`` blocks have unwound (its unfinished outputs discarded)."""


class _Outputs:
    """The outputs of one run, opened before the model loads (opening is the writability check:
    a directory, a read-only filesystem or a missing permission fails here, naming the path)
    and discarded on leaving unless committed.

    ``main`` names the flag of the run's main output: ``--output`` (answers, which finish out of
    order: an :class:`OrderedJsonlWriter`) or prefill's ``--manifests`` (written in input order:
    a :class:`JsonlWriter`)."""

    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack, main: str = "output") -> None:
        from kvbatch.io.batch_output import AtomicSink, JsonlWriter, OrderedJsonlWriter

        url = getattr(args, main)
        self.output: Any = OrderedJsonlWriter(url) if main == "output" else JsonlWriter(url)
        stack.callback(self.output.abort)
        self.errors = JsonlWriter(args.errors) if getattr(args, "errors", None) else None
        if self.errors is not None:
            stack.callback(self.errors.abort)
        self.metrics = AtomicSink(args.metrics, None) if args.metrics else None
        self._metrics_done = False
        stack.callback(self._abort_metrics)

    def write_metrics(self, metrics: dict, committed: str) -> None:
        """``--metrics``, written after the main output: a failure says where that output is
        (``committed``)."""
        from kvbatch.io.batch_output import OutputError

        if self.metrics is None:
            return
        try:
            self.metrics.write((json.dumps(metrics, indent=2) + "\n").encode())
            self._metrics_done = True
            self.metrics.commit()
        except OutputError as exc:
            raise _CannotRun(f"{exc} ({committed})") from None

    def _abort_metrics(self) -> None:
        if self.metrics is not None and not self._metrics_done:
            self.metrics.abort()

    def close_unused(self) -> None:
        """Only a check was wanted (the step opens its own writers): discard them now."""
        self.output.abort()
        if self.errors is not None:
            self.errors.abort()


def _open_run(args: argparse.Namespace, stack: contextlib.ExitStack, outputs: tuple[str, ...],
              main: str = "output", strict: bool = False) -> tuple[_Outputs, Any]:
    """Before the model loads (generate, prefill): no two of the run's files at one path, every
    output opened (the writability check), the input opened and its first line read; a failure
    is one line naming the path. Returns the outputs and the request stream (closed on leaving)."""
    from kvbatch.io.batch_output import OutputError
    from kvbatch.io.batch_requests import InputStreamError, read_requests

    try:
        _check_distinct(args, ("input",), outputs)
        opened = _Outputs(args, stack, main=main)
        requests = read_requests(args.input, strict=strict)
    except (_SamePath, OutputError, InputStreamError) as exc:
        raise _CannotRun(_input_error_text(exc, args.input)) from None
    stack.callback(requests.close)
    return opened, requests


def _load_or_fail(args: argparse.Namespace) -> Any:
    """The engine of ``args``; any load failure (a missing or corrupt model, an unsupported
    architecture) is one line."""
    try:
        return _load_llm(args)
    except Exception as exc:  # noqa: BLE001 - any load failure is fatal, reported in one line
        raise _CannotRun(_load_error(exc)) from None


def _run_step(bar: Any, incomplete: type[Exception], step: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """``step()`` (generate's or prefill's run), its progress ``bar`` closed after. An input that
    broke part-way (``incomplete``, which carries the report: every row before the break is
    answered and committed) gives the report and the error; an unwritable output is one line."""
    from kvbatch.io.batch_output import OutputError

    try:
        return step(), None
    except incomplete as exc:
        return exc.report, exc  # type: ignore[attr-defined]
    except OutputError as exc:
        raise _CannotRun(str(exc)) from None
    finally:
        bar.close()


def cmd_generate(args: argparse.Namespace) -> int:
    from kvbatch.ops.decode.generate import run_jobs
    from kvbatch.ops.decode.lazy_engine import EngineIdentityChanged
    from kvbatch.ops.decode.response_cache import ResponseCacheMismatch
    from kvbatch.ops.jobs import IncompleteInput, tokenize_requests

    with contextlib.ExitStack() as stack:
        # Everything that can fail in a second fails before the model loads.
        outputs, requests = _open_run(args, stack, ("output", "errors", "metrics"), strict=args.strict)
        if args.workers > 1:  # the ranks open their own input and outputs: this was the check
            requests.close()
            outputs.close_unused()
            return _run_worker_group(args, "generate")
        llm = _open_engine(args)
        _say_loaded(args, llm)
        cache = _open_response_cache(args, llm, stack)
        bar = _progress_bar(args, "requests")

        def progress(done: int, rejected: int) -> None:
            bar.update(done - bar.n)
            if rejected:
                bar.set_postfix(rejected=rejected, refresh=False)

        try:
            report, incomplete = _run_step(bar, IncompleteInput, lambda: run_jobs(
                llm, tokenize_requests(llm, requests), outputs.output, errors_url=outputs.errors,
                model_name=args.model, on_progress=progress, response_cache=cache))
        except (ResponseCacheMismatch, EngineIdentityChanged) as exc:
            raise _CannotRun(f"{exc}; nothing was written to {args.output}") from None
        metrics = report.to_json()
        _add_store_metrics(llm, metrics)
        outputs.write_metrics(metrics, f"the results were written to {args.output}")
    if incomplete is not None:
        return _fail(_incomplete_text(incomplete, args.input, report.requests - 1, args.output, "answered in"))
    print(f"{report.succeeded} succeeded, {report.rejected} rejected; "
          f"{report.output_tokens} output tokens in {report.wall_s:.1f} s "
          f"({metrics['output_tokens_per_s']} tok/s){_response_cache_text(report.response_cache)} -> {args.output}", file=sys.stderr)
    return EXIT_REJECTS if report.rejected else EXIT_OK


def _input_error_text(exc: BaseException | str, input_url: str) -> str:
    """An error before any work, as one line (botocore's text runs over several). The input URL
    may carry a credential that the reader's own text repeats without its scheme (s3fs quotes
    ``KEY:SECRET@bucket`` back as a bucket name): masked wherever it appears."""
    from kvbatch.io.urls import one_line

    return one_line(exc if isinstance(exc, BaseException) else Exception(exc), input_url)


def _incomplete_text(error: BaseException | str, input_url: str, rows: int, output: str, done: str) -> str:
    """The one line of a run whose input broke part-way (generate, prefill, the worker group)."""
    return (f"{_input_error_text(error, input_url)}; the {rows} rows read before it are {done} {output}, "
            f"whose last line marks where the input ended")


def _open_engine(args: argparse.Namespace) -> Any:
    """The run's engine. With ``--response-cache`` a :class:`~kvbatch.ops.decode.lazy_engine.LazyEngine`:
    a night whose every row is in the cache never loads the weights (the engine is built at the
    first miss, or now where this machine has not recorded the engine's identity yet)."""
    if not getattr(args, "response_cache", None):
        return _load_or_fail(args)
    from kvbatch.ops.decode.lazy_engine import LazyEngine

    return LazyEngine.open(_engine_spec(args), lambda: _load_or_fail(args))


def _say_loaded(args: argparse.Namespace, llm: Any) -> None:
    """One line once the model is up (or, lazily built, ready to be): which model answers
    (whatever rows ask for), and that the batch has started (a wrapper can wait on it before it
    interrupts)."""
    from kvbatch.ops.decode.lazy_engine import engine_started

    state = "loaded" if engine_started(llm) else "ready (its weights load at the first response-cache miss)"
    print(f"kvbatch: model {args.model} ({args.dtype}, context {llm.max_model_len}) {state}; "
          f"generating {args.input} -> {args.output}", file=sys.stderr, flush=True)


def _run_worker_group(args: argparse.Namespace, command: str) -> int:
    """``--workers W``: start W local ranks of the worker entry point (``kvbatch.ops.decode.worker``, the
    one torchrun runs) and wait; rank 0 writes the output and the metrics."""
    import os
    import tempfile

    from kvbatch.ops.decode.launch import launch_local

    if args.eplb_interval < 0 or args.redundant_experts < 0:
        return _fail("--eplb-interval and --redundant-experts must be >= 0")
    engine = _engine_spec(args)
    if args.device.startswith("cuda"):  # each rank takes GPU LOCAL_RANK (worker_group.init_group), not one fixed index
        engine = dataclasses.replace(engine, device="cuda")
    spec: dict[str, Any] = {
        "command": command, "engine_spec": engine.to_json(),
        "output": args.output, "errors": args.errors, "metrics": args.metrics, "model_name": args.model,
        "eplb_interval": args.eplb_interval, "redundant_experts": args.redundant_experts,
        # The ranks' parts go beside the output (group_outputs.group_parts_url), where a killed run leaves
        # them for its re-run to resume from.
        "checkpoint_rows": args.checkpoint_rows, "resume": args.resume,
    }
    if command == "generate":
        spec["input"] = args.input
        spec["strict"] = args.strict
    else:
        spec["manifests"] = args.manifests
    store = _store_config(args)
    if store is not None:
        spec["kv_store"] = store.model_dump()
    if args.response_cache:  # every rank opens it (worker_commands.rank_response_cache)
        spec["response_cache"] = {"url": args.response_cache, "verify": args.response_cache_verify}
    with tempfile.TemporaryDirectory(prefix="kvbatch-workers-") as tmp:
        spec["report"] = os.path.join(tmp, "report.json")
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        if args.device.startswith("cuda"):  # device tensors: NCCL collectives, one GPU per rank
            os.environ.setdefault("KVBATCH_DIST_BACKEND", "nccl")
        code = launch_local(args.workers, ["--spec", spec_path])
        if code not in (EXIT_OK, EXIT_REJECTS) or not os.path.exists(spec["report"]):
            return code if code not in (EXIT_OK, EXIT_REJECTS) else EXIT_FATAL
        with open(spec["report"], encoding="utf-8") as f:
            m = json.load(f)
    broken = m.get("input_broken")
    if broken:  # rank 0 wrote every row read before the break and the marker line; the CLI says so
        return _fail(_incomplete_text(broken["message"], args.input, broken["lines_read"], args.output,
                                      "answered in"))
    ep = m.get("expert_parallel")
    ep_text = (f"; all-to-all {ep['a2a_bytes_per_token_per_layer']:.0f} B/token/layer, "
               f"{ep['rebalances']} rebalances" if ep else "")
    loaded = (f"; {m['loaded_prompt_tokens']} of {m['prompt_tokens']} prompt tokens loaded from the store"
              if command == "decode" else "")
    resumed = (f", {m['resumed_rows']} of the {m['requests']} rows resumed from an earlier run"
               if m.get("resumed_rows") else "")
    print(f"{m['succeeded']} succeeded, {m['rejected']} rejected{resumed}{loaded}; {m['output_tokens']} output tokens "
          f"in {m['wall_s']:.1f} s on {args.workers} workers ({m['output_tokens_per_s']} tok/s){ep_text}"
          f"{_response_cache_text(m.get('response_cache'))} -> {args.output}", file=sys.stderr)
    return code


def _progress_bar(args: argparse.Namespace, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(desc=desc, unit="req", disable=args.no_progress, file=sys.stderr)


def _add_store_metrics(llm: Any, metrics: dict) -> None:
    if llm.connector is not None:
        metrics["kv_store"] = llm.connector.stats.to_json()
        metrics["kv_store"]["store"] = llm.connector.store.stats()


def cmd_prefill(args: argparse.Namespace) -> int:
    from kvbatch.ops.prefill.prefill import IncompletePrefill, run_prefill

    with contextlib.ExitStack() as stack:
        # As in generate: the input opened and the outputs checked before the model loads.
        outputs, requests = _open_run(args, stack, ("manifests", "metrics"), main="manifests")
        llm = _load_or_fail(args)
        bar = _progress_bar(args, "prefill")
        report, incomplete = _run_step(bar, IncompletePrefill, lambda: run_prefill(
            llm, requests, outputs.output, model_name=args.model, on_progress=lambda n: bar.update(n - bar.n)))
        metrics = report.to_json()
        outputs.write_metrics(metrics, f"the manifests were written to {args.manifests}")
    if incomplete is not None:
        return _fail(_incomplete_text(incomplete, args.input, report.requests - 1, args.manifests,
                                      "prefilled, their manifests in"))
    print(f"prefilled {report.requests - report.rejected} requests ({report.rejected} rejected): "
          f"{report.prompt_tokens_computed} of {report.prompt_tokens} prompt tokens computed, "
          f"{metrics.get('blocks_written', 0)} blocks written in {report.wall_s:.1f} s -> {args.manifests}",
          file=sys.stderr)
    # Prefill exists to store KV: a store that took none (or only some) of it is a failed run.
    not_stored = metrics.get("store", {}).get("puts_failed", 0)
    if not_stored:
        from kvbatch.io.urls import redact

        written = metrics.get("blocks_written", 0)
        stored = "none" if not written else f"only {written}"
        return _fail(f"the KV store at {redact(args.store)} stored {stored} of the {written + not_stored} blocks "
                     f"prefill asked it to store ({not_stored} failed; see the store's metrics and warnings)")
    return EXIT_REJECTS if report.rejected else EXIT_OK


def cmd_decode(args: argparse.Namespace) -> int:
    from kvbatch.io.batch_output import OutputError
    from kvbatch.ops.decode.generate import run_decode
    from kvbatch.ops.decode.response_cache import ResponseCacheMismatch
    from kvbatch.ops.prefill.manifests import ManifestMismatch

    if args.workers > 1:
        return _run_worker_group(args, "decode")
    with contextlib.ExitStack() as stack:
        try:  # outputs checked before the model loads (run_decode opens its own writers)
            _check_distinct(args, ("manifests",), ("output", "errors", "metrics"))
            outputs = _Outputs(args, stack)
            outputs.close_unused()
        except (_SamePath, OutputError) as exc:
            return _fail(str(exc))
        llm = _load_or_fail(args)
        cache = _open_response_cache(args, llm, stack)
        bar = _progress_bar(args, "decode")
        try:
            report = run_decode(llm, args.manifests, args.output, errors_url=args.errors, model_name=args.model,
                                on_progress=lambda done, rej: bar.update(done - bar.n), response_cache=cache)
        except ResponseCacheMismatch as exc:
            return _fail(f"{exc}; nothing was written to {args.output}")
        except OutputError as exc:
            return _fail(str(exc))
        except (FileNotFoundError, PermissionError) as exc:
            return _fail(f"cannot read {args.manifests}: {exc}")
        except (ManifestMismatch, ValueError) as exc:
            return _fail(str(exc))
        finally:
            bar.close()
        metrics = report.to_json()
        _add_store_metrics(llm, metrics)
        outputs.write_metrics(metrics, f"the results were written to {args.output}")
    print(f"{report.succeeded} succeeded, {report.rejected} rejected; {report.loaded_prompt_tokens} of "
          f"{report.prompt_tokens} prompt tokens loaded from the store; {report.output_tokens} output tokens "
          f"in {report.wall_s:.1f} s{_response_cache_text(report.response_cache)} -> {args.output}", file=sys.stderr)
    return EXIT_REJECTS if report.rejected else EXIT_OK


def _store_error(url: str, exc: Exception) -> int:
    """An unreadable or unreachable store: one line, credentials in the URL (or echoed by s3fs) redacted."""
    from kvbatch.io.urls import one_line, redact

    return _fail(f"cannot use the KV store at {redact(url)}: {one_line(exc, url)}")


def cmd_kv_stats(args: argparse.Namespace) -> int:
    from kvbatch.io.kvstore.store import kv_stats

    try:
        out = kv_stats(args.store)
    except Exception as exc:  # noqa: BLE001 - any store failure is reported in one line
        return _store_error(args.store, exc)
    print(json.dumps(out, indent=2, default=str))
    return EXIT_OK


def cmd_kv_compact(args: argparse.Namespace) -> int:
    from kvbatch.io.kvstore.store import kv_compact

    if args.grace_hours < 0:
        return _fail(f"kv compact --grace-hours must be >= 0, got {args.grace_hours}")
    try:
        out = kv_compact(args.store, grace_s=args.grace_hours * 3600)
    except Exception as exc:  # noqa: BLE001 - any store failure is reported in one line
        return _store_error(args.store, exc)
    print(json.dumps(out, indent=2, default=str))
    return EXIT_OK


def cmd_kv_gc(args: argparse.Namespace) -> int:
    from kvbatch.io.kvstore.store import kv_gc

    ttl = args.ttl_hours * 3600 if args.ttl_hours is not None else None
    max_bytes = int(args.max_gb * (1 << 30)) if args.max_gb is not None else None
    unused = args.unused_days * 86400 if args.unused_days is not None else None
    if ttl is None and max_bytes is None and unused is None:
        return _fail("kv gc needs --ttl-hours, --unused-days and/or --max-gb")
    if not 0 <= args.rewrite_below <= 1:
        return _fail(f"kv gc --rewrite-below must be in [0, 1], got {args.rewrite_below}")
    if args.rewrite_grace_hours < 0:
        return _fail(f"kv gc --rewrite-grace-hours must be >= 0, got {args.rewrite_grace_hours}")
    try:
        out = kv_gc(args.store, ttl, max_bytes, unused_s=unused, rewrite_below=args.rewrite_below,
                    rewrite_grace_s=args.rewrite_grace_hours * 3600)
    except Exception as exc:  # noqa: BLE001 - any store failure is reported in one line
        return _store_error(args.store, exc)
    print(json.dumps(out, indent=2, default=str))
    return EXIT_OK


def _load_error(exc: Exception) -> str:
    from kvbatch.engine.models.errors import UnsupportedModelError
    from kvbatch.engine.models.weights import ModelLoadError

    if isinstance(exc, (ModelLoadError, UnsupportedModelError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def cmd_serve(args: argparse.Namespace) -> int:
    from kvbatch.serve.server import ServeConfigError, api_keys, serve
    from kvbatch.serve.settings import MB, settings_from_env

    try:
        keys = api_keys(os.environ.get("KVBATCH_API_KEYS"), args.insecure_no_auth)
        settings = settings_from_env(max_file_bytes=args.max_file_mb * MB, max_requests=args.max_requests,
                                     chunk_rows=args.chunk_rows)
    except (ServeConfigError, ValueError) as exc:
        return _fail(str(exc))
    return serve(settings, keys, args.host, args.port)


def cmd_sample_data(args: argparse.Namespace) -> int:
    from kvbatch.ops.ingest.sample_dataset import write_sample_dataset

    if args.requests < 1:
        return _fail(f"--requests must be >= 1, got {args.requests}")
    n = write_sample_dataset(args.output, args.requests, args.seed, args.max_tokens)
    print(f"wrote {n} requests -> {args.output}", file=sys.stderr)
    return EXIT_OK


class _Terminated(BaseException):
    """SIGTERM, raised where the main thread is, so that every ``with`` unwinds (outputs
    discarded, temp files removed) exactly as for Ctrl-C's KeyboardInterrupt."""


@contextlib.contextmanager
def _signals_unwind() -> Iterator[None]:
    """SIGINT and SIGTERM become exceptions, once: a second signal while the first unwinds is
    ignored, so the clean-up is not cut short into a traceback."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works only there
        yield
        return

    def on_signal(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt if signum == signal.SIGINT else _Terminated

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class _StderrHandler(logging.Handler):
    """The library's warnings (unknown fields, a row asking for another model) as
    ``kvbatch: warning: ...`` lines on whatever ``sys.stderr`` is now."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"kvbatch: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)


@contextlib.contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    logger = logging.getLogger("kvbatch")
    handler = _StderrHandler(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _resolve_device(args: argparse.Namespace) -> str | None:
    """Fix ``--device`` (auto -> cuda:N or cpu) and the default ``--dtype`` that follows from it;
    an error line when the device is not on this machine."""
    if not hasattr(args, "device"):
        return None
    if args.gpu_memory_utilization > 1:
        return f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
    from kvbatch.engine.runtime.engine_config import DeviceUnavailableError, default_dtype_name, resolve_device

    try:
        device = resolve_device(args.device)
    except DeviceUnavailableError as exc:
        return str(exc)
    args.device = str(device)
    args.dtype = args.dtype or default_dtype_name(device)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    error = _resolve_device(args)
    if error is not None:
        return _fail(error)
    with _warnings_to_stderr(), _signals_unwind():
        try:
            return args.func(args)
        except _CannotRun as exc:
            return _fail(str(exc))
        except KeyboardInterrupt:
            print("kvbatch: interrupted (SIGINT); unfinished outputs discarded", file=sys.stderr)
            return EXIT_SIGINT
        except _Terminated:
            print("kvbatch: terminated (SIGTERM); unfinished outputs discarded", file=sys.stderr)
            return EXIT_SIGTERM


def entry() -> None:
    """Console-script entry point: exit with :func:`main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
