"""llama.cpp's own speculative driver (``llama-speculative-simple``) run on an exported JetFlow head.

The binary is built by ``make llama-tools`` from the llama.cpp sources vendored in the pinned
llama-cpp-python sdist (it is not part of the Python package). One process per prompt: it prints the
prompt and the generated text on stdout and its timings and acceptance counts on stderr.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from jetflow.errors import JetFlowError
from jetflow.utils.fs import cache_root

SPECULATIVE = "llama-speculative-simple"
LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp `make llama-tools` builds


def find_llama_tools() -> Path | None:
    """The directory holding llama.cpp's tool binaries: $JETFLOW_LLAMA_TOOLS, else the
    `make llama-tools` build in JetFlow's cache; None when neither has them."""
    env = os.environ.get("JETFLOW_LLAMA_TOOLS")
    candidates = [Path(env)] if env else [cache_root() / f"llama.cpp-{LLAMA_CPP_VERSION}" / "build" / "bin"]
    for d in candidates:
        if (d / SPECULATIVE).is_file():
            return d
    return None


@dataclass
class NativeRun:
    text: str  # the generated text (prompt not included)
    encode_s: float  # prompt processing
    decode_s: float  # generation
    n_predict: int  # tokens generated
    n_drafted: int
    n_accept: int


def _number(pattern: str, text: str, kind=float):
    m = re.search(pattern, text)
    if m is None:
        raise JetFlowError(f"{SPECULATIVE} output has no {pattern!r}:\n{text[-2000:]}")
    return kind(m.group(1))


def run_speculative(target_gguf: str | Path, draft_gguf: str | Path, prompt_text: str, *, max_new_tokens: int,
                    threads: int, n_draft: int = 15, n_ctx: int = 4096, flash_attn: bool = False,
                    tools: Path | None = None, timeout: float = 600) -> NativeRun:
    """Greedy generation by llama.cpp's driver with the draft as ``draft-dflash``: chain drafts of
    ``n_draft`` tokens (at most block_size - 1; the driver's own default is 3)."""
    tools = tools or find_llama_tools()
    if tools is None:
        raise JetFlowError(f"{SPECULATIVE} is not built: run `make llama-tools` or set JETFLOW_LLAMA_TOOLS")
    # -p with --no-escape: `-f` drops a final newline and escape processing rewrites backslashes,
    # either of which would tokenize a different prompt than the one given
    cmd = [str(tools / SPECULATIVE), "-m", str(target_gguf), "-md", str(draft_gguf), "--spec-type", "draft-dflash",
           "-p", prompt_text, "--no-escape", "-n", str(max_new_tokens), "--temp", "0",
           "--spec-draft-n-max", str(n_draft), "-t", str(threads), "-td", str(threads), "-c", str(n_ctx), "-b", str(n_ctx),
           "-fa", "on" if flash_attn else "off"]  # as the reference run: attention kernels change the numbers
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise JetFlowError(f"{SPECULATIVE} failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}")
    out, err = proc.stdout, proc.stderr
    start = out.find(prompt_text)
    if start < 0:
        raise JetFlowError(f"{SPECULATIVE} did not echo the prompt as given; cannot separate its output")
    text = out[start + len(prompt_text):]
    text = text[:-4] if text.endswith("\n\n\n\n") else text.rstrip("\n")
    return NativeRun(text=text,
                     encode_s=_number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", err),
                     decode_s=_number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", err),
                     n_predict=_number(r"n_predict = (\d+)", err, int),
                     n_drafted=_number(r"n_drafted = (\d+)", err, int),
                     n_accept=_number(r"n_accept  = (\d+)", err, int))
