"""specfork's CPU kernels: batch-invariant linear layers over packed (GGUF-quantized, bf16 or
fp32) weights, attention over the KV cache and a whole decoder forward in one call."""

from specfork.kernels.build import kernel_status, load_kernels

__all__ = ["kernel_status", "load_kernels"]
