"""Attention and cache kernels. Each Triton kernel has a pure-PyTorch twin in ``reference``
that is both the CPU path and the test oracle."""
