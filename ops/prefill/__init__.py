"""The prefill stage: every prompt's KV blocks computed once into the KV store, and the manifests decode reads."""
