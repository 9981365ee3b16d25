"""How decode runs: in the run's own process, or as a subprocess launched through Dagster Pipes.

``launcher="pipes_subprocess"`` runs ``python -m kvbatch.ops.decode_worker`` with
``PipesSubprocessClient`` (one process, world size 1). Still a stub beyond that: the intended
``torchrun`` worker group (``world_size`` ranks, gloo/NCCL; ``PipesK8sClient`` on Kubernetes, see
DESIGN.md) is not implemented, and ``world_size != 1`` is refused with a clear message.
"""

from __future__ import annotations

from typing import Literal

import dagster as dg
from pydantic import Field, model_validator


class DecodeClusterResource(dg.ConfigurableResource):
    """Decode worker settings (world size 1 only today)."""

    launcher: Literal["in_process", "pipes_subprocess"] = Field(
        default="in_process", description="in_process, or pipes_subprocess (python -m kvbatch.ops.decode_worker)")
    world_size: int = Field(default=1, ge=1, description="decode ranks (only 1 supported today)")

    @model_validator(mode="after")
    def _check(self) -> "DecodeClusterResource":
        if self.world_size != 1:
            raise ValueError(f"world_size={self.world_size}: multi-rank decode is not implemented yet; use 1")
        return self
