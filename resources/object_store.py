"""The object store the pipeline reads datasets from and writes its tables to."""

from __future__ import annotations

import os
from typing import Any

import dagster as dg
from pydantic import Field, PrivateAttr, field_validator

_SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "abfs://", "az://", "file://", "memory://")
SECRET = {"dagster__is_secret": True}


class ObjectStoreResource(dg.ConfigurableResource):
    """Root URL of every table the pipeline writes (``s3://bucket/prefix``, ``file:///path``,
    an absolute local folder, ``memory://``), plus the fsspec options to reach it.

    Credentials come from ``EnvVar``\\ s (``access_key_id=dg.EnvVar("AWS_ACCESS_KEY_ID")``); they
    are hidden in the UI and never logged or written to metadata. Without them s3fs falls back
    to its usual chain (environment, instance profile).
    """

    url: str = Field(description="root of the pipeline's tables, e.g. s3://bucket/kvbatch")
    endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint (MinIO, R2, loopback)")
    region: str | None = Field(default=None, description="S3 region")
    access_key_id: str | None = Field(default=None, json_schema_extra=SECRET)
    secret_access_key: str | None = Field(default=None, json_schema_extra=SECRET)
    anon: bool = Field(default=False, description="anonymous access (public buckets)")
    # An unreachable store must cost seconds, not the run: every S3 request gives up after these.
    connect_timeout_s: float = Field(default=5.0, gt=0, le=300, description="S3 connect timeout per request")
    read_timeout_s: float = Field(default=20.0, gt=0, le=3600, description="S3 read timeout (idle socket) per request")
    # The deployment's root when this store is one pipeline's folder of it (``under``).
    _shared_url: str | None = PrivateAttr(default=None)

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("object store url must not be empty")
        if "://" in v:
            if not v.startswith(_SCHEMES):
                raise ValueError(f"object store url {v!r}: unsupported scheme (use one of {', '.join(_SCHEMES)})")
        elif not os.path.isabs(v):
            raise ValueError(f"object store url {v!r}: a local folder must be an absolute path")
        return v.rstrip("/")

    def under(self, folder: str) -> ObjectStoreResource:
        """The same store rooted at ``<url>/<folder>`` (one pipeline's tables), remembering the
        deployment's root in :attr:`shared_url` (what pipelines share: the KV store, responses)."""
        if not folder or "/" in folder or folder in (".", ".."):
            raise ValueError(f"folder {folder!r} must be one path component")
        fields = {k: getattr(self, k) for k in type(self).model_fields}
        store = type(self)(**{**fields, "url": f"{self.url}/{folder}"})
        store._shared_url = self.shared_url
        return store

    @property
    def shared_url(self) -> str:
        """The deployment's root: this store's url, or the one it was re-rooted from."""
        return self._shared_url or self.url

    @property
    def protocol(self) -> str:
        return self.url.split("://", 1)[0] if "://" in self.url else "file"

    def storage_options(self) -> dict[str, Any]:
        """fsspec options for URLs on this store (empty for local files)."""
        if self.protocol not in ("s3", "s3a"):
            return {}
        opts: dict[str, Any] = {}
        if self.endpoint_url:
            opts["endpoint_url"] = self.endpoint_url
        if self.access_key_id:
            opts["key"] = self.access_key_id
        if self.secret_access_key:
            opts["secret"] = self.secret_access_key
        if self.anon:
            opts["anon"] = True
        if self.region:
            opts["client_kwargs"] = {"region_name": self.region}
        opts["config_kwargs"] = {"connect_timeout": self.connect_timeout_s, "read_timeout": self.read_timeout_s}
        return opts

    def options_for(self, url: str) -> dict[str, Any]:
        """The store's options for ``url`` when it is on the same kind of store, else none."""
        proto = url.split("://", 1)[0] if "://" in url else "file"
        return self.storage_options() if proto == self.protocol else {}

    def __repr__(self) -> str:  # keep secrets out of logs and tracebacks (a URL may carry some too)
        from kvbatch.io.urls import redact

        endpoint = redact(self.endpoint_url) if self.endpoint_url else None
        return f"ObjectStoreResource(url={redact(self.url)!r}, endpoint_url={endpoint!r})"

    __str__ = __repr__
