"""``d9d bench kernels``: its flags (``_parser``), its run (``_command``) and the kernel
benchmark (``_kernels``, the cases it times in ``_cases`` and ``_fp8_cases``)."""
