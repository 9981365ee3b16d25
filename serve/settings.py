"""What the server reads from the environment: the same variables as the pipeline
(``KVBATCH_ROOT``, ``KVBATCH_MODEL``, ``KVBATCH_S3_*``, ``DAGSTER_HOME``), so one deployment
serves both, plus the API keys and the limits."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MB = 1 << 20
DEFAULT_MAX_FILE_BYTES = 200 * MB  # OpenAI's Batch API limits
DEFAULT_MAX_REQUESTS = 50_000


@dataclass(frozen=True)
class ServeSettings:
    root: str  # the pipeline's object store root; the server keeps its state under <root>/batch_api
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)  # may hold credentials
    model: str = "smollm2-135m"
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_requests: int = DEFAULT_MAX_REQUESTS
    chunk_rows: int = 256  # rows per committed part: what a restart can lose and re-run at most
    poll_s: float = 0.5  # how often running batches are looked at
    max_attempts: int = 3  # runs started for one batch before it is failed (each resumes the last)

    @property
    def state_url(self) -> str:
        return self.root.rstrip("/") + "/batch_api"


def settings_from_env(env: Mapping[str, str] | None = None, **overrides: Any) -> ServeSettings:
    """The pipeline's object store and model from the environment (``KVBATCH_ROOT`` defaults to
    ``./kvbatch_data`` as in the pipeline's definitions)."""
    from kvbatch.resources.object_store import ObjectStoreResource

    env = os.environ if env is None else env
    store = ObjectStoreResource(url=env.get("KVBATCH_ROOT", os.path.abspath("kvbatch_data")),
                                endpoint_url=env.get("KVBATCH_S3_ENDPOINT_URL"), region=env.get("KVBATCH_S3_REGION"),
                                access_key_id=env.get("AWS_ACCESS_KEY_ID"),
                                secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"))
    return ServeSettings(root=store.url, storage_options=store.storage_options(),
                         model=env.get("KVBATCH_MODEL", "smollm2-135m"),
                         **{k: v for k, v in overrides.items() if v is not None})
