"""Render the kvbatch pages of a running Dagster UI in headless Chromium and check what a person sees.

    .venv/bin/python scripts/ui_check.py [--url http://127.0.0.1:3000] [--out ui_check_shots]

Needs Playwright (`pip install -e '.[ui]'`) and Debian's Chromium (`apt-get install -y chromium`,
driven at /usr/bin/chromium; `--browser` for another path), and a `dagster-webserver` (or
`dagster dev`) on the kvbatch code location whose instance holds a day run through the named jobs
(`make demo` makes one; docs/pipeline.md says how to open the UI on it). The pages:

- asset ``kvbatch/cost_rollup``: description, owners, kinds, the day's scorecard (shown first:
  the latency SLO, the shards needing a look, the hosted batch price), the five plotted figures,
  the ``slo``, ``shards_needing_a_look`` and ``shard_figures`` tables, no ASCII bars, no "No
  description provided";
- asset ``kvbatch/cost_metrics``: its summary's token classes with $/Mtok and MiB;
- the asset checks of ``cost_metrics`` and ``decode_results``: named, described;
- the latest ``kvbatch_shard`` run: its job named, prefill and decode progress lines in its log;
- automation: the schedule and the sensors listed, each page with its description;
- jobs: the named jobs.

Prints one PASS/FAIL line per page, saves a screenshot of each under ``--out``, exits 1 if any
check failed (2 if the UI cannot be reached).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 45_000
NO_DESCRIPTION = "No description provided"


@dataclass
class Page:
    """A UI route and what a person must (and must not) see on it."""

    name: str
    route: str
    must_see: list[str]
    must_not_see: list[str] = field(default_factory=lambda: [NO_DESCRIPTION])
    click: str | None = None  # a button to press before reading (a collapsed markdown summary)
    log_filter: str | None = None  # a run page: filter its (virtualized) event log to these lines first
    known_problems: list[str] = field(default_factory=list)  # found without the browser (GraphQL)


def latest_run(url: str, job: str) -> tuple[str, str | None] | None:
    """(run id, code location it was launched from) of the newest run of ``job``, through the UI's
    GraphQL API; None when the job has no run."""
    query = ('{ runsOrError(filter: {pipelineName: "JOB"}, limit: 1) { ... on Runs { results { runId '
             'repositoryOrigin { repositoryLocationName } } } } }').replace("JOB", job)
    req = urllib.request.Request(url.rstrip("/") + "/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        runs = json.load(resp)["data"]["runsOrError"].get("results") or []
    if not runs:
        return None
    origin = runs[0]["repositoryOrigin"]
    return runs[0]["runId"], origin and origin["repositoryLocationName"]


def pages(url: str, location: str, pipeline: str = "kvbatch") -> list[Page]:
    """The pages of one pipeline (its assets are under ``/assets/<pipeline>/``, its jobs,
    schedule and sensors are named ``<pipeline>_*``: pipelines/factory.py)."""
    shard_run = latest_run(url, f"{pipeline}_shard")
    asset = f"/assets/{pipeline}"
    sensors = f"/locations/{location}/sensors/{pipeline}"
    automations = [f"{pipeline}_{a}" for a in ("nightly_ingest", "shards_after_ingest", "rollup_after_shard",
                                               "rollup_after_failed_shard", "new_dataset_files")]
    out = [
        # The day's scorecard (pipelines/scorecard_metadata.py): the report first (its verdict, the
        # SLO and the shards needing a look at the top), five plotted figures, three tables.
        Page("asset cost_rollup", f"{asset}/cost_rollup",
             ["The night at a glance", "Owners", "kvbatch", "Kinds", "Polars", "scorecard", "cost_usd",
              "tokens_per_s", "kv_hit_rate_pct", "ttft_s_p95", "tpot_s_p95", "slo", "shards_needing_a_look",
              "shard_figures", "Latency SLO", "Shards needing a look", "hosted batch price"],
             [NO_DESCRIPTION, "█", "spec_acceptance_pct"], click="Show Markdown"),
        # A shard's cost: the summary's token classes with units, $/Mtok, MiB.
        Page("asset cost_metrics", f"{asset}/cost_metrics",
             ["One row per (date, shard)", "Owners", "Kinds", "usd_per_mtok_output", "device_s_prefill",
              "device_s_decode", "token class", "$ per Mtok", "MiB", "billable: prompt + output tokens"],
             [NO_DESCRIPTION, "█"], click="Show Markdown"),
        Page("asset decode_results", f"{asset}/decode_results",
             ["One row per request", "results_preview", "finish_reason", "PyTorch"]),
        Page("checks of cost_metrics", f"{asset}/cost_metrics?view=checks",
             ["latency_p95_within_slo", "P95 time to first token"]),
        Page("checks of decode_results", f"{asset}/decode_results?view=checks",
             ["one_result_per_custom_id", "Every row of the shard has exactly one result"]),
        Page("automation", "/automation", automations, []),
        Page(f"schedule {pipeline}_nightly_ingest", f"/locations/{location}/schedules/{pipeline}_nightly_ingest",
             ["ingest the day that just ended"]),
        Page(f"sensor {pipeline}_rollup_after_shard", f"{sensors}_rollup_after_shard",
             ["re-roll that date's cost_rollup"]),
        Page(f"sensor {pipeline}_shards_after_ingest", f"{sensors}_shards_after_ingest",
             [f"one {pipeline}_shard run per"]),
        Page("jobs", "/jobs", [f"{pipeline}_ingest", f"{pipeline}_shard", f"{pipeline}_rollup"], []),
    ]
    if shard_run:
        run_id, origin = shard_run
        # A run from another code location (dagster asset materialize, dagster job execute) makes the
        # UI warn on re-execute: "The original run loaded ... from a different code location".
        wrong = [] if origin == location else [(f"run {run_id} was not launched from code location {location!r} "
                                               f"(origin: {origin}): re-execute warns")]
        out.append(Page(f"run of {pipeline}_shard", f"/runs/{run_id}",
                        [f"{pipeline}_shard", "prefill: ", "decode: ", "rows (", "ETA"], ["Job: None"],
                        log_filter="tokens/s", known_problems=wrong))
    else:  # fails: no shard run to show
        out.append(Page(f"run of {pipeline}_shard", "/runs", [f"{pipeline}_shard"], []))
    return out


def check_page(page, base: str, spec: Page, shots: Path) -> list[str]:
    """What is wrong on one page (empty when it reads as it should). The first expected text is
    waited for (the UI loads its data after the page); ``click`` then opens the collapsed part."""
    page.goto(base.rstrip("/") + spec.route, wait_until="domcontentloaded")
    problems = list(spec.known_problems)
    for i, text in enumerate(spec.must_see):
        try:
            page.get_by_text(text, exact=False).first.wait_for(state="attached", timeout=WAIT_MS if i == 0 else 10_000)
        except Exception:  # noqa: BLE001 - Playwright's timeout: the text never appeared
            problems.append(f"does not show {text!r}")
        if i == 0 and spec.log_filter:
            page.get_by_placeholder("Filter…").first.fill(spec.log_filter)
        if i == 0 and spec.click:
            try:
                page.get_by_text(spec.click).first.click(timeout=10_000)
            except Exception:  # noqa: BLE001
                problems.append(f"has no {spec.click!r} to press")
    body = page.inner_text("body")
    problems += [f"shows {text!r}" for text in spec.must_not_see if text in body]
    page.screenshot(path=str(shots / (spec.name.replace(" ", "_") + ".png")), full_page=True)
    if spec.click:
        page.keyboard.press("Escape")
    return problems


def run(url: str, out: Path, browser: str, location: str, pipeline: str = "kvbatch") -> int:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    try:
        specs = pages(url, location, pipeline)
    except (urllib.error.URLError, OSError, KeyError) as e:
        print(f"cannot reach the Dagster UI at {url}: {e}", file=sys.stderr)
        return 2
    failed = 0
    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=browser, args=CHROMIUM_ARGS, headless=True)
        try:
            page = chrome.new_page(viewport={"width": 1600, "height": 1200})
            for spec in specs:
                problems = check_page(page, url, spec, out)
                failed += bool(problems)
                print(("FAIL" if problems else "PASS") + f"  {spec.name} ({spec.route})"
                      + "".join(f"\n      {p}" for p in problems))
        finally:
            chrome.close()
    print(f"{len(specs) - failed}/{len(specs)} pages read as they should; screenshots in {out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/ui_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:3000", help="the Dagster UI (default %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("ui_check_shots"), help="screenshot folder")
    ap.add_argument("--browser", default=CHROMIUM, help="Chromium executable (default %(default)s)")
    ap.add_argument("--location", default="kvbatch", help="code location name (workspace.yaml)")
    ap.add_argument("--pipeline", default="kvbatch", help="the pipeline whose pages to read (its name in defs/)")
    args = ap.parse_args(argv)
    if not Path(args.browser).exists():
        print(f"no Chromium at {args.browser}: apt-get install -y chromium (or give --browser)", file=sys.stderr)
        return 2
    return run(args.url, args.out, args.browser, args.location, args.pipeline)


if __name__ == "__main__":
    sys.exit(main())
