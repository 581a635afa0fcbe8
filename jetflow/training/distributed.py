"""Data-parallel training under ``torchrun``: joining the process group, and which process reports."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed() -> None:
    """Under ``torchrun`` (WORLD_SIZE > 1) join the process group: nccl on GPUs, gloo on CPU. Before
    the target loads, so that each process puts it on its own GPU."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
