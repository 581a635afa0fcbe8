"""A description of the machine a measurement was taken on, stored with every result."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    cuda = torch.cuda.is_available()
    return {"platform": platform.platform(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "cuda": torch.cuda.get_device_name() if cuda else None}
