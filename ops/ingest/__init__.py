"""The ingest stage: a prompt dataset read and validated row by row into the prompts and rejects tables."""
