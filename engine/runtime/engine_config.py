"""The engine's own settings: cache geometry, batch limits, numerics mode, device. Independent of
the model (that is :class:`~kvbatch.engine.models.config.ModelConfig`).

``resolve_device`` turns ``auto | cpu | cuda | cuda:N`` into a ``torch.device`` or refuses at
once, with one line naming the device, so a run never starts on a machine it cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The CPU projection kernels a user may name (kernel_choice.LINEAR_CHOICES, kept here too so the
# config and the CLI validate without importing torch; a test holds the two equal).
LINEAR_CHOICES = ("auto", "onednn", "blas", "mkl")

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"

# The engine's numerics version: bump it with any change to kernels, the sampler or the decode
# step that can change a request's output tokens or logprobs. It is part of every response cache
# key (ops/decode/response_cache.py), so a changed engine never serves answers of the old one.
NUMERICS_VERSION = 2

# The weight and cache dtypes by the names the CLI and configs accept -> torch's name for each.
# Kept torch-free: a tokenizing step needs the name (it is part of every KV key), not torch.
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}


def dtype_name(dtype: Any) -> str:
    """torch's name (``float32``) of a dtype given by name (``fp32``) or as a ``torch.dtype``."""
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r} (use fp32 or bf16)")
        return DTYPE_NAMES[dtype]
    return str(dtype).removeprefix("torch.")


class DeviceUnavailableError(ValueError):
    """The requested device does not exist on this machine; the message is one line naming it."""


@dataclass
class EngineConfig:
    """Knobs of the engine, independent of the model."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_bytes (CPU) or free memory (CUDA)
    kv_cache_bytes: int = 1 << 30  # CPU cache budget; on CUDA gpu_memory_utilization sizes it
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (decode tokens + prefill chunks)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # Pad small GEMMs so that a row's result does not depend on how many other rows share the
    # step (bitwise batch invariance on CPU BLAS: small batches are padded to 24 rows in fp32, 48 in
    # bf16, several times the work at batch 1; off by default).
    batch_invariant: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto: CUDA when present)
    # CUDA: the share of the device's memory the engine may hold (weights + activations + KV
    # cache); the cache gets what is left of it after a warm-up pass.
    gpu_memory_utilization: float = 0.9
    # CUDA: run decode steps eagerly instead of replaying CUDA graphs captured per batch bucket.
    enforce_eager: bool = False
    # fp32 matmuls: "highest" (IEEE fp32), "high" (TF32 on CUDA) or "medium"; set explicitly so a
    # GPU run does not silently lose precision to TF32.
    matmul_precision: str = "highest"
    # CPU projection kernel: "auto" measures oneDNN packed, BLAS, MKL packed (fp32) and the native
    # GEMV against each other per row-count bucket on this machine (cached on disk); "onednn" /
    # "blas" / "mkl" force one. See kernels/cpu/kernel_choice.py.
    linear: str = "auto"
    # Dense projection weights: "full" (the compute dtype), "int8" (weight-only, per-output-
    # channel scales, CPU only) or "gguf" (a GGUF file's own Q4_0/Q4_1/Q8_0 blocks where a native
    # kernel measures faster, fp32 activations, CPU only); quality deltas in docs/performance.md.
    weights: str = "full"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.matmul_precision not in ("highest", "high", "medium"):
            raise ValueError(f"matmul_precision must be highest, high or medium, got {self.matmul_precision!r}")
        parse_device_spec(self.device)
        if self.linear not in LINEAR_CHOICES:
            raise ValueError(f"linear must be one of {', '.join(LINEAR_CHOICES)}, got {self.linear!r}")
        if self.weights not in ("full", "int8", "gguf"):
            raise ValueError(f"weights must be full, int8 or gguf, got {self.weights!r}")


def parse_device_spec(spec: str) -> tuple[str, int | None]:
    """``"cuda:1"`` -> ``("cuda", 1)``; raises :class:`DeviceUnavailableError` for anything
    that is not ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    text = str(spec).strip().lower()
    if text in ("auto", "cpu", "cuda"):
        return text, None
    kind, _, index = text.partition(":")
    if kind == "cuda" and index.isdigit():
        return "cuda", int(index)
    raise DeviceUnavailableError(f"device {spec!r} is not one of {DEVICE_CHOICES}")


def resolve_device(spec: str = "auto") -> Any:
    """The ``torch.device`` for ``spec``: ``auto`` is ``cuda`` (the current device) when CUDA is
    available, else ``cpu``. An unavailable CUDA device raises :class:`DeviceUnavailableError`."""
    import torch

    kind, index = parse_device_spec(spec)
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device {spec!r} requested, but CUDA is not available on this machine "
                                     f"(torch {torch.__version__}, {'no CUDA build' if torch.version.cuda is None else 'no GPU visible'})")
    count = torch.cuda.device_count()
    if index is None:
        index = torch.cuda.current_device()
    if index >= count:
        raise DeviceUnavailableError(f"device {spec!r} requested, but this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


def default_dtype_name(device: Any) -> str:
    """bf16 on CUDA (the tensor cores' type), fp32 on the CPU."""
    return "bf16" if getattr(device, "type", str(device)) == "cuda" else "fp32"


def kv_blocks_from_memory(total_bytes: int, used_bytes: int, peak_activation_bytes: int, utilization: float,
                          bytes_per_block: int) -> int:
    """How many KV blocks fit on a device: the engine may hold ``utilization * total_bytes``;
    what is already held (``used_bytes``: weights, this process's other tensors) and the peak a
    warm-up pass needed beyond it (``peak_activation_bytes``) come off first. Raises
    ``ValueError`` when not even one block fits (with the figures)."""
    budget = int(total_bytes * utilization) - used_bytes - peak_activation_bytes
    blocks = budget // bytes_per_block if budget > 0 else 0
    if blocks < 1:
        gib = 1 << 30
        raise ValueError(
            f"no room for the KV cache: {utilization:.2f} x {total_bytes / gib:.1f} GiB allowed, "
            f"{used_bytes / gib:.2f} GiB held, {peak_activation_bytes / gib:.2f} GiB of activations at peak; "
            f"raise gpu_memory_utilization or lower max_num_batched_tokens")
    return int(blocks)
