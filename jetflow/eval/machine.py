"""A description of the machine a measurement was taken on, stored with every result."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

from jetflow.utils.cpus import usable_cpus


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The vector extensions that decide this project's speeds: AVX2 vs AVX-512 sets how fast llama.cpp's
# quantized dot products run, AMX how cheap a batched bf16/int8 matmul (a tree verify) is next to one token.
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """Which of :data:`SPEED_FLAGS` the CPU reports (empty where /proc/cpuinfo is missing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [f for f in SPEED_FLAGS if f in present]
    except OSError:
        pass
    return []


def machine() -> dict:
    cuda = torch.cuda.is_available()
    out = {"platform": platform.platform(), "cpu": cpu_name(), "cpu_flags": cpu_flags(), "cpu_count": os.cpu_count(), "usable_cpus": usable_cpus(),
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "cuda": torch.cuda.get_device_name() if cuda else None}
    if "llama_cpp" in sys.modules:  # a llama.cpp measurement: which build (kernels) it ran on
        from jetflow.models.llamacpp_target import llama_build

        out["llama_cpp"] = llama_build()
    return out
