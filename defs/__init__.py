"""The code location's dg defs folder (``[tool.dg.project] defs_module = "kvbatch.defs"``): one
folder per pipeline, each a ``defs.yaml`` of ``type: kvbatch.BatchInference``."""
