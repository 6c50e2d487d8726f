"""CPU-only stand-in package, never needed on GPUs. SGLang 0.5.23's RotaryEmbedding imports
`vllm._custom_ops` on platforms that are neither CUDA nor SGLang's own CPU engine
(`SGLANG_USE_CPU_ENGINE=1` needs sgl_kernel's CPU build, which is not on PyPI)."""
