"""The decode stage: the one decode loop, its outputs (JSONL, a shard's results, part files) and the worker group."""
