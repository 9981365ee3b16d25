"""Prices that turn device-seconds, stored bytes, requests and egress into dollars in ``cost_metrics``.

The attribution of those dollars to token classes is ``kvbatch.ops.results.cost`` (docs/metrics.md).
"""

from __future__ import annotations

import dagster as dg
from pydantic import Field, model_validator

DEVICE_KINDS_DEFAULT = {"cpu-host": 0.08}
STORAGE_DEFAULT = {"memory": 0.0, "disk": 0.08, "object": 0.023}
RETENTION_DEFAULT = {"memory": 0.0, "disk": 1.0, "object": 7.0}
REQUESTS_DEFAULT = {"GET": 0.0004, "HEAD": 0.0004, "PUT": 0.005, "LIST": 0.005, "DELETE": 0.0}


class ReferencePricesConfig(dg.Config):
    """A hosted batch API's list prices, dollars per million tokens, to compare the night against."""

    usd_per_mtok_input: float = Field(ge=0, description="uncached input tokens")
    usd_per_mtok_cached_input: float = Field(ge=0, description="cached input tokens")
    usd_per_mtok_output: float = Field(ge=0, description="output tokens")


class PricingResource(dg.ConfigurableResource):
    """Dollar rates, each validated (>= 0, known keys):

    - ``usd_per_device_hour``: device kind -> $ per device-hour (a CPU host, a GPU model);
      ``prefill_device`` and ``decode_device`` name the kind each stage ran on, and must be priced.
      Prefill is charged at ``prefill_devices`` devices, decode at the decode group's width.
    - ``usd_per_gb_month_by_tier`` and ``retention_days_by_tier`` (memory, disk, object): storage is
      GB-month, prorated by how long the tier keeps a block (the KV store's retention by last use).
    - ``usd_per_1k_requests``: $ per 1,000 object-store requests by kind (GET, PUT, LIST, HEAD,
      DELETE), from the KV store's own counts.
    - ``usd_per_gb_egress``: $ per GB leaving the region, charged on the results when
      ``results_leave_region`` and on object-tier KV reads when ``kv_object_reads_leave_region``.
    - ``reference``: optional hosted batch API prices; the UI then shows what the night saved.

    The defaults are list prices of the kind of machine kvbatch runs on by default (a small 2-vCPU
    cloud VM, S3 standard storage and requests, local SSD, free in-region transfer); set your own
    for real cost figures.
    """

    usd_per_device_hour: dict[str, float] = Field(default_factory=lambda: dict(DEVICE_KINDS_DEFAULT))
    prefill_device: str = "cpu-host"
    prefill_devices: int = Field(default=1, ge=1)
    decode_device: str = "cpu-host"
    usd_per_gb_month_by_tier: dict[str, float] = Field(default_factory=lambda: dict(STORAGE_DEFAULT))
    retention_days_by_tier: dict[str, float] = Field(default_factory=lambda: dict(RETENTION_DEFAULT))
    usd_per_1k_requests: dict[str, float] = Field(default_factory=lambda: dict(REQUESTS_DEFAULT))
    usd_per_gb_egress: float = Field(default=0.09, ge=0)
    results_leave_region: bool = False
    kv_object_reads_leave_region: bool = False
    reference: ReferencePricesConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> PricingResource:
        self.pricing()  # the plain-Python Pricing validates every rate and key, naming the bad one
        return self

    def pricing(self, decode_devices: int = 1):  # -> kvbatch.ops.results.cost.Pricing
        from kvbatch.ops.results.cost import Pricing, ReferencePrices

        ref = self.reference
        return Pricing(
            usd_per_device_hour=dict(self.usd_per_device_hour), prefill_device=self.prefill_device,
            prefill_devices=self.prefill_devices, decode_device=self.decode_device, decode_devices=decode_devices,
            usd_per_gb_month_by_tier=dict(self.usd_per_gb_month_by_tier),
            retention_days_by_tier=dict(self.retention_days_by_tier),
            usd_per_1k_requests=dict(self.usd_per_1k_requests), usd_per_gb_egress=self.usd_per_gb_egress,
            results_leave_region=self.results_leave_region,
            kv_object_reads_leave_region=self.kv_object_reads_leave_region,
            reference=None if ref is None else ReferencePrices(ref.usd_per_mtok_input, ref.usd_per_mtok_cached_input,
                                                               ref.usd_per_mtok_output))
