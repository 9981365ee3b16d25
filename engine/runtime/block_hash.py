"""Content addresses of KV blocks: a hash chain rooted at the model fingerprint.

A block's key is ``sha256(parent_key || token ids as little-endian int32)``; the root key is
derived from the model fingerprint, the KV dtype, the block size and the layout version, so
blocks of another model, dtype or layout can never be mixed in, and the keys are the same in
every process and on every machine (unlike Python's ``hash``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvbatch.engine.runtime.engine_config import dtype_name

KV_LAYOUT_VERSION = 1


def kv_layout_dtype(dtype: object, weights: str = "full") -> str:
    """The KV dtype as block keys name it: torch's dtype name, and the weight format when the
    weights are not full (``float32+int8-weights``): int8 or GGUF weights give other K/V than
    full ones, so their blocks must never mix."""
    name = dtype_name(dtype)
    return name if weights == "full" else f"{name}+{weights}-weights"


def root_key(fingerprint: str, kv_dtype: str, block_size: int) -> str:
    text = f"kvbatch-kv|layout={KV_LAYOUT_VERSION}|model={fingerprint}|dtype={kv_dtype}|block={block_size}"
    return hashlib.sha256(text.encode()).hexdigest()


def block_key(parent_key: str, token_ids: Sequence[int]) -> str:
    h = hashlib.sha256(bytes.fromhex(parent_key))
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.hexdigest()


def chain_keys(root: str, token_ids: Sequence[int], block_size: int, start_key: str | None = None,
               start_block: int = 0) -> list[str]:
    """Keys of every full block of ``token_ids`` from ``start_block`` on, continuing a chain
    whose last key is ``start_key`` (the root when starting from block 0)."""
    keys = []
    parent = start_key if start_key is not None else root
    for b in range(start_block, len(token_ids) // block_size):
        parent = block_key(parent, token_ids[b * block_size:(b + 1) * block_size])
        keys.append(parent)
    return keys


def window_key(key: str) -> str:
    """The address of a block's sliding-layer part (models whose sliding layers keep only their
    window store it apart, and only for the window at a prompt's end): derived from the block's
    own key, so it is as content-addressed as the block."""
    return hashlib.sha256(b"window|" + bytes.fromhex(key)).hexdigest()


def store_fingerprint(model_fingerprint: str, kv_dtype: str, block_size: int) -> str:
    """What a KV store checks every block against: the exact KV layout of a model (weights,
    KV dtype, block size, layout version), short enough for object names."""
    return root_key(model_fingerprint, kv_dtype, block_size)[:32]
