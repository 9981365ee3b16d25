"""The engine's runtime: the ``LLM`` facade (``llm``) over a scheduler that deals in counts and
ids (``scheduler``), a paged KV block manager with prefix caching (``block_manager``,
``block_hash``), per-request state (``sequence``), the model runner that turns a step into one
forward pass (``model_runner``), sampling (``sampler``, ``sampling_params``), the engine's knobs
(``engine_config``), and the connector to the external KV store (``kv_connector``).
"""
