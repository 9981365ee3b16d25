"""``kvbatch serve``: OpenAI's Files and Batches API over the kvbatch pipeline.

Modules: ``settings`` (what the server reads from the environment), ``auth`` (bearer keys and
owners), ``objects`` (the File and Batch objects as OpenAI documents them), ``state`` (durable
records on the object store), ``files`` (uploads, limits, downloads), ``batches`` (a batch's
life: validate, launch, follow, cancel, finalize, recover), ``launcher`` and ``worker`` (the
only modules that talk to the Dagster instance), ``app`` (the HTTP routes), ``server`` (uvicorn).
"""
