"""The CPU backend: what runs a model's projections and decode steps on the CPU.

``native`` (``native.c`` and the ``native_*.c`` parts it includes) holds a decode step's C kernels:
the small ops, decode attention over the paged cache, the GEMV and the fused decode layers;
``gguf_kernels`` (``gguf_kernels.c``) multiplies GGUF blocks (``gguf_blocks``) as the file holds
them; ``native_build`` compiles both at first use for this CPU. ``linear`` keeps each projection's
weight in the layout of the kernel that runs it (oneDNN packed, BLAS, the native GEMV, MKL's packed
sgemm in ``mkl_packed``, the int8 routes of ``quant``, GGUF blocks), ``kernel_choice`` measures
which kernel wins each row-count bucket on this machine, ``greedy_head`` is the screened fp32 LM
head of greedy steps, ``huge_pages`` holds weights and the KV cache in 2 MiB pages, and ``machine``
(torch-free) names this machine to every cache of measured kernels and built libraries.
Nothing here imports ``kvbatch.engine``: the engine's models call down into these.
"""
