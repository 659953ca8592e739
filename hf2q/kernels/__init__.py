"""Fused kernels with ops references; they know nothing of the runtime."""
