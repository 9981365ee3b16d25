"""The pipeline's steps as plain Python (no Dagster), one sub-package per stage, in the order a
night runs them: ``ingest`` -> ``shards`` -> ``prefill`` -> ``decode`` -> ``results``.

Shared by every stage: ``engine_build`` (the one builder: an ``EngineSpec`` into an ``LLM``, its
KV store and fingerprint), ``fingerprint`` and ``tokenizer_source_cache`` (a model's identity and
tokenizer without its weights) and ``jobs`` (a request rendered, tokenized and checked).
"""
