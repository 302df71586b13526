"""torch_memory_saver.testing_utils on sublet: the helpers the original's examples and tests
import (get_device, empty_cache, get_and_print_gpu_memory), for CUDA."""

from __future__ import annotations

import torch

from .utils import is_xpu

__all__ = ["is_xpu", "get_device", "empty_cache", "get_and_print_gpu_memory"]


def get_device() -> str:
    return "cuda"


def empty_cache() -> None:
    torch.cuda.empty_cache()


def get_and_print_gpu_memory(message, gpu_id=0):
    """Prints and returns the device's used memory as nvidia-smi counts it; without pynvml
    (which torch.cuda.device_memory_used needs), the driver's total - free: the same figure."""
    try:
        mem = torch.cuda.device_memory_used(gpu_id)
    except ModuleNotFoundError:
        free, total = torch.cuda.mem_get_info(gpu_id)
        mem = total - free
    print(f"GPU {gpu_id} memory: {mem / 1024 ** 3:.2f} GB ({message})")
    return mem
