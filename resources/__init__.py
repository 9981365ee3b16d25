"""Dagster ConfigurableResources: object store, model, KV store, pricing, decode cluster."""

from kvbatch.resources.decode_cluster import DecodeClusterResource
from kvbatch.resources.kv_store import KVStoreResource
from kvbatch.resources.model import ModelResource
from kvbatch.resources.object_store import ObjectStoreResource
from kvbatch.resources.pricing import PricingResource

__all__ = ["DecodeClusterResource", "KVStoreResource", "ModelResource", "ObjectStoreResource", "PricingResource"]
