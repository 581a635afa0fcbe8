"""vLLM serving an exported JetFlow head (DFlash chain mode): runs only where the vLLM venv exists
(`make test-vllm` builds it and runs this file); skipped with the reason otherwise."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = Path(os.environ.get("JETFLOW_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
DRAFTER = Path(os.environ.get("JETFLOW_VLLM_DRAFTER", ROOT / "jetflow" / "drafters" / "smollm2-135m-instruct-dflash"))

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM venv not found at {VLLM_PY}: run `make test-vllm`"),
    pytest.mark.skipif(not (DRAFTER / "config.json").exists(),
                       reason=f"no DFlash-compatible drafter at {DRAFTER} (set JETFLOW_VLLM_DRAFTER)"),
]


def test_vllm_serves_the_exported_head_losslessly_with_jetflows_acceptance(tmp_path):
    out = tmp_path / "vllm.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "--drafter", str(DRAFTER),
                           "--limit", "3", "--max-tokens", "48", "--vllm-python", str(VLLM_PY), "--out", str(out)],
                          capture_output=True, text=True, timeout=3000)
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["checks"] == {"vllm_spec_equals_plain": True, "vllm_tau_above_1": True, "tau_close": True,
                                "first_draft_token_agrees": True}, proc.stdout
