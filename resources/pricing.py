"""Prices that turn device seconds and bytes into dollars in ``cost_metrics``."""

from __future__ import annotations

import dagster as dg
from pydantic import Field


class PricingResource(dg.ConfigurableResource):
    """Dollar rates: a device-hour (one GPU, or one CPU host), a GB added to the KV store, a GB
    moved (KV read back, results written). The defaults are list prices of the kind of machine
    kvbatch runs on by default (a small 2-vCPU cloud VM, S3 standard storage for a month, free
    in-region transfer); set your own for real cost figures."""

    usd_per_device_hour: float = Field(default=0.08, ge=0)
    usd_per_gb_stored: float = Field(default=0.023, ge=0)
    usd_per_gb_moved: float = Field(default=0.0, ge=0)

    def pricing(self, devices: int = 1):  # -> kvbatch.ops.cost.Pricing
        from kvbatch.ops.cost import Pricing

        return Pricing(self.usd_per_device_hour, self.usd_per_gb_stored, self.usd_per_gb_moved, devices)
