"""Hot-path kernels (Triton) and their PyTorch reference twins; import through ``dispatch``."""
