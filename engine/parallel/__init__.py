"""Expert parallelism: experts spread over a ``torch.distributed`` worker group with
all-to-all dispatch and combine (``expert_parallel``), and their placement by load (``eplb``)."""
