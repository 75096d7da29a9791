"""Triton kernels behind the ``triton`` backends; imported only when one first runs.

Importing these modules imports Triton and decorates the kernels, so ``TRITON_INTERPRET=1``
must be set before the first Triton backend call for the kernels to run on CPU.
"""
