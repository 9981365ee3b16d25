"""``kvbatch response-cache gc``: retention of the response cache's entries by last use and size.

Registered by :func:`kvbatch.cli.main.build_parser` (:func:`add_parser`); the work is
:func:`kvbatch.ops.decode.response_cache_gc.response_cache_gc` (docs/response-cache.md, "Retention").
Exit status 0 with the gc's report (JSON) on stdout, 2 with one line on stderr when the options are
wrong or the store cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_OK, EXIT_FATAL = 0, 2


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``response-cache`` and its ``gc`` under the ``kvbatch`` command's subparsers ``sub``."""
    rc = sub.add_parser("response-cache", help="clean the response cache (docs/response-cache.md)")
    rc_sub = rc.add_subparsers(dest="response_cache_command", required=True)
    gc = rc_sub.add_parser("gc", help="delete entries unused for some days, then the least recently used beyond a size")
    gc.add_argument("--cache", required=True, metavar="URI",
                    help="the cache, as --response-cache names it (a folder, file:// or s3:// URL)")
    gc.add_argument("--unused-days", type=float, default=None,
                    help="delete entries neither written nor served for this many days")
    gc.add_argument("--max-gb", type=float, default=None,
                    help="then delete the least recently used entries until at most this many GiB remain")
    gc.set_defaults(func=cmd_response_cache_gc)


def _fail(msg: str) -> int:
    print(f"kvbatch: error: {msg}", file=sys.stderr)
    return EXIT_FATAL


def cmd_response_cache_gc(args: argparse.Namespace) -> int:
    from kvbatch.io.urls import one_line, redact
    from kvbatch.ops.decode.response_cache_gc import response_cache_gc

    if args.unused_days is None and args.max_gb is None:
        return _fail("response-cache gc needs --unused-days and/or --max-gb")
    if args.unused_days is not None and not args.unused_days >= 0:
        return _fail(f"response-cache gc --unused-days must be >= 0, got {args.unused_days}")
    if args.max_gb is not None and not args.max_gb >= 0:
        return _fail(f"response-cache gc --max-gb must be >= 0, got {args.max_gb}")
    try:
        out = response_cache_gc(args.cache, unused_days=args.unused_days, max_gb=args.max_gb)
    except Exception as exc:  # noqa: BLE001 - any store failure is reported in one line
        return _fail(f"response-cache gc at {redact(args.cache)}: {one_line(exc, args.cache)}")
    print(json.dumps(out, indent=2))
    return EXIT_OK
