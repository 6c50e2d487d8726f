"""Loaded at start-up by every interpreter of a live CPU SGLang server (the launcher puts this folder on
PYTHONPATH; SGLang spawns its scheduler and detokenizer, which inherit it). CPU-only workarounds, never
needed on GPUs:

- `torchvision_shim` defines the `torchvision::nms` op schemas the CUDA-built torchvision wheel expects
  beside CPU torch; it must precede every sglang import;
- `nixl_dram` makes SGLang's NIXL connector register host KV pools as DRAM (only with
  `BASIN_NIXL_DRAM=1`);
- the `vllm` stand-in package beside this file satisfies an import SGLang's rotary layer makes on CPU.
"""

import os

import torchvision_shim  # noqa: F401

if os.environ.get("BASIN_NIXL_DRAM") == "1":
    import nixl_dram  # noqa: F401
