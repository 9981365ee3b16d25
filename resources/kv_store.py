"""The tiered KV store: memory -> local disk -> object store."""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import Field, model_validator

GB = 1 << 30


class KVStoreResource(dg.ConfigurableResource):
    """Where prefill puts KV blocks and decode finds them. ``url`` defaults to ``<object store>/kv``
    and uses the object store's credentials when it is on the same kind of store. Tiers: an
    in-process memory LRU (``memory_gb``, 0 = off), an optional local disk cache (``disk_dir``),
    and the durable object tier, with an optional TTL and size cap applied by ``kvbatch kv gc``."""

    url: str | None = Field(default=None, description="durable tier; default <object store url>/kv")
    memory_gb: float = Field(default=2.0, ge=0, description="memory tier budget (0 = no memory tier)")
    disk_dir: str | None = Field(default=None, description="local disk tier folder (none = no disk tier)")
    disk_gb: float = Field(default=20.0, gt=0, description="disk tier budget")
    ttl_hours: float | None = Field(default=None, gt=0, description="durable blocks expire after this")
    max_gb: float | None = Field(default=None, gt=0, description="durable tier size cap")
    response_cache: str | None = Field(
        default=None, description="exact response cache across runs (docs/response-cache.md): a URL, or "
                                  "'default' for <object store url>/responses; none = off")
    response_cache_verify: float = Field(default=0.0, ge=0, le=1,
                                         description="share of response cache hits recomputed and compared")

    @model_validator(mode="after")
    def _check(self) -> "KVStoreResource":
        if self.url is not None and not self.url.strip():
            raise ValueError("kv store url must not be empty (leave it unset for <object store>/kv)")
        return self

    def store_config(self, default_url: str, storage_options: dict[str, Any]) -> Any:
        from kvbatch.io.kvstore.store import KVStoreConfig

        url = self.url or default_url.rstrip("/") + "/kv"
        same = (url.split("://", 1)[0] if "://" in url else "file") == \
               (default_url.split("://", 1)[0] if "://" in default_url else "file")
        return KVStoreConfig(
            url=url, memory_bytes=int(self.memory_gb * GB), disk_dir=self.disk_dir, disk_bytes=int(self.disk_gb * GB),
            ttl_s=self.ttl_hours * 3600 if self.ttl_hours else None,
            max_bytes=int(self.max_gb * GB) if self.max_gb else None,
            storage_options=dict(storage_options) if same else {})

    def response_cache_options(self, default_url: str, storage_options: dict[str, Any]) -> dict[str, Any] | None:
        """Where the response cache is and how to reach it (``url``, ``verify``, ``storage_options``:
        the object store's credentials when it is on the same kind of store), what a worker group's
        spec carries; None when ``response_cache`` is unset."""
        if not self.response_cache:
            return None
        url = default_url.rstrip("/") + "/responses" if self.response_cache == "default" else self.response_cache
        same = (url.split("://", 1)[0] if "://" in url else "file") == \
               (default_url.split("://", 1)[0] if "://" in default_url else "file")
        return {"url": url, "verify": self.response_cache_verify,
                "storage_options": dict(storage_options) if same else {}}

    def open_response_cache(self, default_url: str, storage_options: dict[str, Any], llm: Any) -> Any:
        """The response cache for ``llm``'s engine (:meth:`response_cache_options`), or None."""
        options = self.response_cache_options(default_url, storage_options)
        if options is None:
            return None
        from kvbatch.ops.decode.response_cache import ResponseCache

        return ResponseCache.for_llm(options["url"], llm, verify=options["verify"],
                                     storage_options=options["storage_options"])

    def open(self, default_url: str, storage_options: dict[str, Any], engine_spec: Any) -> Any:
        """The store, checking blocks against ``engine_spec``'s KV fingerprint (the one builder's)."""
        from kvbatch.ops.engine_build import open_kv_store

        return open_kv_store(engine_spec, self.store_config(default_url, storage_options))
