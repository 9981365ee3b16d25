"""Shared fixtures: the real default model, loaded once per test session.

Only tests that ask for these fixtures pay for them (the checkpoint ~5 s, the transformers
reference ~25 s), and they are built lazily, on first use.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The measured-kernel choices and the fingerprint records go to a folder of this session, not the
# user's ~/.cache/kvbatch: a test must neither read an earlier run's choices nor leave its own.
os.environ.setdefault("KVBATCH_CACHE_DIR", tempfile.mkdtemp(prefix="kvbatch-test-cache-"))

import pytest
from hypothesis import HealthCheck, settings

# CI (CI=true) runs every property test derandomized: each test's examples come from a seed
# derived from the test itself, so a CI failure replays on any machine; a failure prints the
# blob that reproduces it. Locally hypothesis draws fresh examples (and prints the @seed to rerun).
settings.register_profile("kvbatch-ci", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
if os.environ.get("CI", "").lower() in ("true", "1"):
    settings.load_profile("kvbatch-ci")


def _hypothesis_line(config) -> str:
    """Which hypothesis profile runs and where its seeds come from (derandomize wins over a
    --hypothesis-seed, as in hypothesis itself)."""
    profile = settings.get_current_profile_name()
    seed = config.getoption("hypothesis_seed", None)
    if settings.default.derandomize:
        how = "derandomized: each test's seed is derived from the test, failures print a @reproduce_failure blob"
    elif seed is not None:
        how = f"seed {seed} for every test (--hypothesis-seed)"
    else:
        how = "random seeds: a failure prints the @seed(...) that reproduces it"
    return f"hypothesis: profile {profile!r}, {how}"


def pytest_report_header(config):
    return _hypothesis_line(config)


_CI = os.environ.get("CI", "").lower() in ("true", "1")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """In CI, a green run with a skip this machine's hardware does not explain fails
    (tests/skip_policy.py); the skip summary (-rs) lists every reason."""
    if not _CI or exitstatus != 0 or hasattr(session.config, "workerinput"):
        return
    from tests.skip_policy import disallowed_skips, skip_reason

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    bad = disallowed_skips([skip_reason(r.longrepr) for r in skipped])
    if bad:
        for reason in bad:
            reporter.write_line(f"CI does not accept this skip (tests/skip_policy.py): {reason}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # `make test` (CI) runs pytest -q, which prints no header: the line goes at the end instead.
    if config.get_verbosity() < 0:
        terminalreporter.write_line(_hypothesis_line(config))


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """SmolLM2-135M-Instruct from the bundled Q4_1 GGUF, dequantized to fp32.

    Build engines from it with ``LLM(smollm2_checkpoint, ...)``: each engine copies what it
    needs, so engines with different configs or dtypes do not re-read the file.
    """
    from kvbatch.engine.models.weights import load_checkpoint

    return load_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_checkpoint):
    """An fp32 ``LLM`` with the default engine config. Shared: leave no spies or state behind."""
    from kvbatch.engine.runtime.llm import LLM

    return LLM(smollm2_checkpoint)


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' fp32 model read from the same GGUF: the reference for parity tests."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvbatch.engine.models.weights import resolve_model

    path = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint on loopback (moto's threaded server), as s3fs tests itself."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint):
    """(url, storage_options, fs) of a fresh bucket on the loopback S3."""
    import uuid

    import s3fs

    opts = {"key": "testing", "secret": "testing", "endpoint_url": s3_endpoint}
    fs = s3fs.S3FileSystem(**opts)
    bucket = f"kv-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    return f"s3://{bucket}/kv", opts, fs


@pytest.fixture
def s3_fault_proxy(s3_endpoint):
    """(endpoint_url, proxy): a fault-injecting loopback proxy in front of the loopback S3
    (tests/s3_fault_proxy.py); program it with ``proxy.plan(...)``, ``proxy.refuse()``."""
    from tests.s3_fault_proxy import FaultProxy

    host, port = s3_endpoint.removeprefix("http://").rsplit(":", 1)
    with FaultProxy(host, int(port)) as proxy:
        yield proxy.endpoint_url, proxy
