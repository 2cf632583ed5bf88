"""The Triton kernels (CUDA; the tests run them under ``TRITON_INTERPRET=1`` on CPU at tiny shapes) and the
occupancy rules that size their launches. Called through the public surface in ``pagedray.kernels``."""
