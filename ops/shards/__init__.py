"""The shard stage: prompts tokenized, keyed by KV block and split into shards by hash of custom_id."""
