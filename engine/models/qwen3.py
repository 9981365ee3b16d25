"""Qwen3 (dense): the common decoder with an RMSNorm over each query and key head before rotary.

``head_dim`` is its own setting (not ``hidden_size / num_attention_heads``), which the common
decoder already reads; ``attention_bias`` would bias ``o_proj`` as well and is refused. The same
q/k norms serve Qwen3-MoE, whose MoE settings live in :class:`~kvbatch.engine.models.config.MoEConfig`.
"""

from __future__ import annotations

from kvbatch.engine.models.family import Family, register_family

QWEN3 = register_family(Family(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True, bias_refused=True))
