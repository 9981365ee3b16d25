"""The tiered, content-addressed KV block store: memory -> local disk -> object store.

Import what you need from its modules (this file imports nothing, so importing one module does
not load the rest):

- `store`: `KVStore`, `KVStoreConfig`, `kv_stats`, `kv_compact`, `kv_gc`: the store as a whole;
- `tiers`: the tier interface, miss reasons and counters; the memory and local-disk tiers;
- `object_tier`: `ObjectStoreTier`, the durable tier on any fsspec URL (write buffer, reads);
- `object_layout`: its paths under the store's root, every request it makes, the layout marker;
- `faults`: transient errors, `RetryPolicy`, `CircuitBreaker`, the bounded transport;
- `gc`: usage files, index scans, `gc_objects` and `object_stats`;
- `block_format`: many KV blocks packed into one Arrow IPC segment;
- `index_files`: the per-segment index file format and its validation;
- `index`, `index_pages`, `compaction`: the index partitioned by key, its paged partitions, compaction;
- `rewrite`: gc's rewrite of mostly-dead segments;
- `request_counts`: object-store requests counted by kind.
"""
