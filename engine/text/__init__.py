"""Text in and out of the engine: chat templates and tokenization (``tokenizer``), incremental
detokenization and stop strings (``stop_checker``)."""
