"""JetFlow's multi-token tiles (third_party/llama-cpp-python) against ggml's own one-row kernel, called
through ctypes on random q4_1 and q8_0 matrices: every output bit for bit, for every path of the tile
(2-3 tokens in registers, 4-16 through scratch, odd row counts, an odd number of blocks per row)."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

from jetflow.eval.machine import cpu_flags
from jetflow.models.loading import llamacpp_available

GGML_TYPE_Q4_1, GGML_TYPE_Q8_0 = 3, 8
# bytes per block of 32 weights: q4_1 (d, m, 16 nibble bytes), q8_1 (d, s, 32), q8_0 (d, 32)
X_BLOCK = {GGML_TYPE_Q4_1: 20, GGML_TYPE_Q8_0: 34}
Y_BLOCK = {GGML_TYPE_Q4_1: 36, GGML_TYPE_Q8_0: 34}


@pytest.fixture(scope="module")
def ggml_cpu():
    return load_ggml_cpu()


def load_ggml_cpu() -> dict:
    """The tile, and per weight type its quantizers and ggml's one-row kernel, from the ggml CPU library
    llama.cpp loaded (skips where there is none, fails where the patch should be and is not)."""
    if not llamacpp_available():
        pytest.skip("llama-cpp-python is not installed")
    from jetflow.models.llamacpp_target import _import_binding, _loaded_cpu_library

    _import_binding()
    path = _loaded_cpu_library()
    if path is None:
        pytest.skip("no ggml CPU library found beside llama.cpp")
    lib = ctypes.CDLL(str(path))
    if not hasattr(lib, "jetflow_mul_mat_tile"):
        patched = hasattr(lib, "jetflow_quant_dot_columns")  # the patch's marker, on every architecture
        if not patched and platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= set(cpu_flags()):
            pytest.fail("llama-cpp-python was built without third_party/llama-cpp-python's patch")
        pytest.skip("the tiles are built on x86 with AVX2 and FMA only")
    lib.ggml_cpu_init()  # fills ggml's fp16 table, which both kernels read
    lib.jetflow_mul_mat_tile.restype = ctypes.c_int
    lib.jetflow_mul_mat_tile.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                         ctypes.c_size_t]
    quantize = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    vec_dot = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                               ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    base = ctypes.CDLL(str(path.with_name("libggml-base.so")))
    return {
        "tile": lib.jetflow_mul_mat_tile,
        GGML_TYPE_Q4_1: (quantize(("quantize_row_q4_1_ref", base)), quantize(("quantize_row_q8_1", lib)),
                         vec_dot(("ggml_vec_dot_q4_1_q8_1", lib))),
        GGML_TYPE_Q8_0: (quantize(("quantize_row_q8_0_ref", base)), quantize(("quantize_row_q8_0", lib)),
                         vec_dot(("ggml_vec_dot_q8_0_q8_0", lib))),
    }


def quantized_rows(quantize, rows: np.ndarray, block: int, rng) -> np.ndarray:
    """Rows quantized into a buffer whose rows are padded with random bytes (so that a kernel which took
    them for contiguous would read garbage): ``out[i, :n // 32 * block]`` is row i."""
    n = rows.shape[1]
    out = rng.integers(0, 256, (rows.shape[0], n // 32 * block + 48), dtype=np.uint8)
    for i, row in enumerate(np.ascontiguousarray(rows, dtype=np.float32)):
        quantize(row.ctypes.data, out[i].ctypes.data, n)
    return out


@pytest.mark.parametrize("kind", [GGML_TYPE_Q4_1, GGML_TYPE_Q8_0])
@pytest.mark.parametrize("n,rows,cols", [(576, 16, 2), (576, 16, 3), (576, 16, 4), (576, 16, 5), (576, 16, 6),
                                         (576, 16, 16), (288, 15, 7), (288, 15, 10), (288, 1, 3), (1536, 16, 9),
                                         (576, 3, 1), (96, 2, 13)])
def test_a_tile_equals_one_row_dot_products_bit_for_bit(ggml_cpu, kind, n, rows, cols):
    quantize_x, quantize_y, vec_dot = ggml_cpu[kind]
    rng = np.random.default_rng(n * 100 + rows * 10 + cols)
    x = quantized_rows(quantize_x, rng.normal(0, 0.05, (rows, n)), X_BLOCK[kind], rng)
    y = quantized_rows(quantize_y, rng.normal(0, 2.0, (cols, n)), Y_BLOCK[kind], rng)
    reference = np.zeros((cols, rows), dtype=np.float32)
    for c in range(cols):
        for r in range(rows):
            vec_dot(n, reference[c, r:].ctypes.data, 0, x[r].ctypes.data, 0, y[c].ctypes.data, 0, 1)
    out = np.full((cols + 1, 16), np.nan, dtype=np.float32)  # the chunk loop's layout: 16 floats per column
    assert ggml_cpu["tile"](kind, n, rows, cols, out.ctypes.data, 16, x.ctypes.data, x.strides[0],
                            y.ctypes.data, y.strides[0]) == 1
    assert np.abs(reference).max() > 0
    np.testing.assert_array_equal(out[:cols, :rows].view(np.uint32), reference.view(np.uint32))
    assert np.isnan(out[:cols, rows:]).all() and np.isnan(out[cols]).all()  # nothing written past the tile


def test_a_tile_declines_other_types_and_shapes(ggml_cpu):
    out = np.full(16 * 16, np.nan, dtype=np.float32)
    x = np.zeros(64 * 34, dtype=np.uint8)
    for args in [(2, 64, 2, 2), (GGML_TYPE_Q8_0, 64, 17, 2), (GGML_TYPE_Q8_0, 64, 2, 17), (GGML_TYPE_Q8_0, 48, 2, 2)]:
        kind, n, rows, cols = args  # 2: q4_0, which the tiles leave to ggml; 17 rows or columns; n not whole blocks
        assert ggml_cpu["tile"](kind, n, rows, cols, out.ctypes.data, 16, x.ctypes.data, 68, x.ctypes.data, 68) == 0
    assert np.isnan(out).all()  # and wrote nothing
