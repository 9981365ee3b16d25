"""Hot-path kernels (Triton, native C for the CPU) and their PyTorch reference twins; import through
``dispatch``. ``cpu`` is the CPU backend: the native C kernels and their build, the projection
layouts and the kernel choice, huge pages, and ``cpu.machine`` (torch-free), which names this
machine to every cache of measured kernels and built libraries."""
