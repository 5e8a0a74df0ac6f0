"""How a benchmark script names its device and its result files: one rule for every script."""
from __future__ import annotations

import platform


def device_name(device) -> str:
    """The GPU's name (``NVIDIA H200``), else ``cpu (<processor>)``."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'x86'})"


def result_stem(prefix: str, name: str, tag: str = "") -> str:
    """``<prefix>_h200`` on an H200, ``_cuda`` on another GPU, ``_cpu`` on CPU (``name`` from :func:`device_name`),
    then ``_<tag>`` if given."""
    kind = "h200" if "H200" in name else "cpu" if name.startswith("cpu") else "cuda"
    return f"{prefix}_{kind}" + (f"_{tag}" if tag else "")
