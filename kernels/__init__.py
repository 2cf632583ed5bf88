"""pagedray.kernels"""
