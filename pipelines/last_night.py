"""``spec: suffix:last-night``: a pipeline drafting from its own answers of the night before.

The decode step of day D resolves it to the results of the pipeline's most recent earlier day that
has any (``results/date=D'/shard=*/part.parquet``: usually D - 1; a day the pipeline did not run is
passed over), read by the suffix drafter as ``--spec suffix:URL`` would read them. On the first
night there is nothing to draft from: the step drafts by prompt lookup alone (``ngram``) and says so.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from kvbatch.io.shard_tables import PART, join
from kvbatch.pipelines.layout import DayLayout

_DAY = re.compile(r"^date=(\d{4}-\d{2}-\d{2})$")
# The controller's LAST_NIGHT spelled out: the definitions load without the engine (torch).
SUFFIX_LAST_NIGHT = "suffix:last-night"


def last_night_results(day: DayLayout, storage_options: dict[str, Any] | None = None) -> str | None:
    """A glob of the results of the latest day before ``day.date`` that has any, or None. One
    listing of ``results/`` and one per candidate day, newest first (a night's first earlier
    day with results is almost always the day before)."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(join(day.root, "results"), **(storage_options or {}))
    try:
        entries = fs.ls(base, detail=False)
    except FileNotFoundError:
        return None
    days = sorted((m.group(1) for m in (_DAY.match(e.rstrip("/").rsplit("/", 1)[-1]) for e in entries) if m),
                  reverse=True)
    for earlier in (d for d in days if d < day.date):
        pattern = DayLayout(day.root, earlier).table("results", f"shard=*/{PART}")
        if fs.glob(pattern):  # (fsspec strips the URL's protocol itself)
            return pattern
    return None


def resolve_last_night(spec: Any, day: DayLayout, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``spec`` (an :class:`~kvbatch.engine.spec.EngineSpec`) with ``suffix:last-night`` replaced
    by the earlier night's results, or by ``ngram`` where there is none; and what was chosen, in
    words, for the step's log and metadata. Any other spec is returned as it is."""
    if spec.speculative != SUFFIX_LAST_NIGHT:
        return spec, spec.speculative or "none"
    found = last_night_results(day, storage_options)
    if found is None:
        return (dataclasses.replace(spec, speculative="ngram"),
                f"ngram ({SUFFIX_LAST_NIGHT} found no results of a day before {day.date}: prompt lookup alone)")
    return (dataclasses.replace(spec, speculative=f"suffix:{found}", spec_corpus_options=storage_options or None),
            f"suffix:{found}")
