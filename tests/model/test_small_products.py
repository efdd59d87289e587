"""Products of 2 to 16 rows in kvmem's CUDA kernel (``small_products_kernel``, runtime.model.small_products).

The kernel runs on CUDA only: the device tests at the end compare it with MLX's own product there, and
``python -m benches gpu_probe``'s products section times it. Here, on the CPU, it is replaced by what it
must compute (``x @ w.T``), and the tests hold the rest: which layers and which row counts reach it, that a
model answers as it does without it, and that the setting reaches the profile only on CUDA.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import models_dir

from runtime.backend import decide_profile
from runtime.model import small_products
from runtime.model.fused_projections import fuse_projections
from runtime.model.loaded import load_model


@pytest.fixture
def kernel_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each call to the kernel, by its rows (the kernel replaced by its definition)."""
    rows: list[int] = []

    def kernel(x: mx.array, w: mx.array) -> mx.array:
        rows.append(x.shape[0])
        return x @ w.T

    monkeypatch.setattr(small_products, "small_product", kernel)
    return rows


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])  # qwen2's query, key and value projections have biases
def test_every_float_layer_fused_or_not_takes_2_to_16_rows_and_the_logits_stay(name: str, kernel_rows) -> None:
    lm = load_model(name, models_dir=models_dir(), numpy_attention=False)
    model = lm.model
    tokens = mx.array([list(range(3, 3 + 12))])
    before = model(tokens)
    fused = fuse_projections(model)
    layers = small_products.take_small_products(model)
    linear = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert fused > 0 and layers == len(linear) and all(type(m) is small_products.SmallRowsLinear for m in linear)
    after = model(tokens)
    assert kernel_rows and set(kernel_rows) == {12}  # every product of the pass, 12 rows each
    assert mx.allclose(after, before, atol=1e-4, rtol=1e-4).item()
    kernel_rows.clear()
    model(tokens[:, :1])  # one row: MLX's gemv, as fast a launch already
    model(mx.array([list(range(3, 3 + small_products.MAX_ROWS + 1))]))  # more rows: cuBLASLt, faster there
    assert kernel_rows == []


def test_the_kernel_refuses_what_it_does_not_compute() -> None:
    w = mx.zeros((8, 32))
    with pytest.raises(ValueError, match="rows"):
        small_products.small_product(mx.zeros((small_products.MAX_ROWS + 1, 32)), w)
    with pytest.raises(ValueError, match="rows"):
        small_products.small_product(mx.zeros((4, 16)), w)  # widths that differ
    with pytest.raises(ValueError, match="rows"):
        small_products.small_product(mx.zeros((4, 32), dtype=mx.bfloat16), w)  # dtypes that differ


def test_the_setting_reaches_the_profile_on_cuda_only_and_a_cpu_load_leaves_the_layers() -> None:
    assert decide_profile(device="gpu", backend="cuda", small_products_kernel=True).small_products_kernel
    assert "small products in kvmem's kernel" in decide_profile(device="gpu", backend="cuda",
                                                                small_products_kernel=True).line()
    assert decide_profile(device="gpu", backend="cuda").small_products_kernel  # the GPU policy's default
    assert not decide_profile(device="gpu", backend="cuda", small_products_kernel=False).small_products_kernel
    assert not decide_profile(device="gpu", backend="cuda", profile="cpu").small_products_kernel
    assert not decide_profile(device="gpu", backend="metal", small_products_kernel=True).small_products_kernel
    forced = decide_profile(device="cpu", backend="cpu", profile="gpu", small_products_kernel=True)
    assert not forced.small_products_kernel
    lm = load_model("tiny-llama", models_dir=models_dir(), numpy_attention=False, small_products_kernel=True)
    taken = any(type(m) is small_products.SmallRowsLinear for _, m in lm.model.named_modules())
    assert taken == small_products.available()  # the kernel is CUDA's: a CPU load keeps MLX's layers


@pytest.mark.skipif(not small_products.available(),
                    reason="the kernel is CUDA's: run on a GPU (benches/gpu_session.sh)")
@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize("shape", [(64, 32), (100, 70), (2048, 2048)])  # widths off the warp and block sizes too
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_on_the_device_the_kernel_gives_mlxs_product(rows: int, shape: tuple[int, int], dtype: mx.Dtype) -> None:
    mx.random.seed(rows)
    w = (mx.random.normal(shape) * shape[1] ** -0.5).astype(dtype)
    x = mx.random.normal((rows, shape[1])).astype(dtype)
    reference = (x.astype(mx.float32) @ w.astype(mx.float32).T)  # float32 products, whatever the dtype
    tolerance = {mx.float32: 1e-4, mx.bfloat16: 2e-2, mx.float16: 2e-3}[dtype]  # the output's own rounding
    flat = mx.concatenate([mx.zeros((1,), dtype), x.reshape(-1)])
    for operand in (x, flat[1:].reshape(x.shape)):  # aligned (16-byte loads), and one element into a buffer
        ours = small_products.small_product(operand, w).astype(mx.float32)
        assert ours.shape == (rows, shape[0])
        assert mx.allclose(ours, reference, atol=tolerance, rtol=tolerance).item(), mx.abs(ours - reference).max()


def test_a_load_checks_the_kernel_against_mlxs_product_and_keeps_mlxs_when_it_fails(
        kernel_rows, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """MLX compiles a custom kernel at its first call: the load makes it, not a turn, and holds it to MLX's
    product; a kernel that does not give it (or does not build) is reported in one line and not used."""
    assert small_products.check(mx.float32) is None  # the kernel as its definition: it passes
    assert kernel_rows == [2, 2, 9, 9, 16, 16]  # each product aligned and one element into a buffer
    assert "not a dtype" in small_products.check(mx.int32)
    monkeypatch.setattr(small_products, "small_product", lambda x, w: x @ w.T + 0.5)
    assert "off MLX's product" in small_products.check(mx.bfloat16)

    def broken(x, w):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(small_products, "small_product", broken)
    assert "no kernel image" in small_products.check(mx.float16)
    monkeypatch.setattr(small_products, "available", lambda: True)
    for problem in (None, "off by a mile"):
        checked: list[mx.Dtype] = []
        monkeypatch.setattr(small_products, "check", lambda dtype: checked.append(dtype) or problem)
        with caplog.at_level("WARNING", logger="kvmem"):
            lm = load_model("tiny-llama", models_dir=models_dir(), numpy_attention=False, small_products_kernel=True)
        taken = any(type(m) is small_products.SmallRowsLinear for _, m in lm.model.named_modules())
        assert checked == [lm.float_dtype] and taken == (problem is None)
    assert "small products kernel is off, its check at load failed: off by a mile" in caplog.text


@pytest.mark.skipif(not small_products.available(),
                    reason="the kernel is CUDA's: run on a GPU (benches/gpu_session.sh)")
def test_on_the_device_the_load_check_passes_for_every_dtype() -> None:
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        assert small_products.check(dtype) is None, dtype
