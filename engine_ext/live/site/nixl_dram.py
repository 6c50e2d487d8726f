"""CPU-only workaround, never needed on GPUs: SGLang 0.5.23's NIXL connector registers and describes KV
memory as "VRAM". On CPU the KV pools are host memory, and UCX without CUDA refuses a VRAM registration
(`NIXL_ERR_BACKEND`, "VRAM memory is detected as host by UCX"), so map VRAM to DRAM.

Imported in every SGLang process (the server spawns its scheduler and detokenizer) through a `.pth`
line that `setup-live.sh` installs, only when `BASIN_NIXL_DRAM=1`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nixl._api as _api

_Agent = _api.nixl_agent


def _dram(name: str, pos: int) -> None:
    """Wrap `nixl_agent.<name>` so that a memory type "VRAM" at positional `pos` (or `mem_type=`) reads
    "DRAM"."""
    original: Callable[..., Any] = getattr(_Agent, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        args_list = list(args)
        if len(args_list) > pos and args_list[pos] == "VRAM":
            args_list[pos] = "DRAM"
        if kwargs.get("mem_type") == "VRAM":
            kwargs["mem_type"] = "DRAM"
        return original(self, *args_list, **kwargs)

    wrapper.__name__ = name
    setattr(_Agent, name, wrapper)


for _name, _pos in (
    ("register_memory", 1),
    ("get_xfer_descs", 1),
    ("get_reg_descs", 1),
    ("prep_xfer_dlist", 2),
):
    _dram(_name, _pos)
