"""Test-harness shim for vLLM's Mooncake worker on a CPU-only torch (never product code).

vLLM 0.32's Mooncake connector asks `torch.accelerator.current_device_index()` for the
device its KV lives on; a CPU-only torch raises there. The suite's engines run with this
file's folder on PYTHONPATH, so Python imports it at start-up and the call answers 0 (the
CPU). Nothing else changes.
"""

from __future__ import annotations


def _patch() -> None:
    try:
        import torch
    except ImportError:
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return
    original = accelerator.current_device_index

    def current_device_index() -> int:
        try:
            return int(original())
        except (RuntimeError, AssertionError, ValueError):
            return 0

    accelerator.current_device_index = current_device_index


_patch()
