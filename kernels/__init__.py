"""Hot-path kernels (Triton, native C for the CPU) and their PyTorch reference twins; import through
``dispatch``. ``machine`` (torch-free) names this machine to every cache of measured kernels and
built libraries."""
