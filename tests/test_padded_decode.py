"""A padded decode batch's attention in one kernel (``padded_decode_kernel``, CUDA; issue 33).

The kernel itself runs on CUDA only: ``python -m benches gpu_probe``'s batch-attention rows compare it
with MLX's masked attention on the device. Here, on the CPU, the kernel is replaced by what it must
compute (MLX's attention with the padding mask built from each row's first key), and the tests hold
the rest: which steps reach it and with which first keys, that a batch decoded through it replies as
each row decodes alone, and that the setting reaches the profile only on CUDA.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from agreement import assert_decoded_alike
from conftest import tiny

from runtime.backend import decide_profile
from runtime.execution.decode_batch import DecodeBatch
from runtime.execution.generate import decode_alone
from runtime.execution.sequence import Sequence, SequenceSampling
from runtime.kv import padded_decode

FLOAT_TOL = 2e-3
PROMPTS = ["The harbour master kept a ledger of ships. " * 3, "Once upon a time in a quiet town, " * 5,
           "Numbers: one two three four five six. " * 2, "A list of fruits and their colours. " * 4]


def _what_the_kernel_computes(queries, keys, values, *, scale, starts):
    mask = mx.arange(keys.shape[2])[None, None, None, :] >= starts[:, None, None, None]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The first keys each call to the kernel got, the kernel replaced by its definition."""
    calls: list[list[int]] = []

    def kernel(queries, keys, values, *, scale, starts):
        calls.append(starts.tolist())
        return _what_the_kernel_computes(queries, keys, values, scale=scale, starts=starts)

    monkeypatch.setattr(padded_decode, "padded_decode_attention", kernel)
    return calls


def _decode(lm, batched: bool, prompts: list[str] = PROMPTS, max_tokens: int = 8) -> list[Sequence]:
    """Each prompt's turn, alone or in one decode batch (the GPU policy's: run ahead, a lone row on its own caches)."""
    seqs = []
    for prompt in prompts:
        seq = Sequence(lm, prompt, None, SequenceSampling(max_tokens=max_tokens), attention="at-rest")
        seq.logits_trace = []
        seqs.append(seq)
    if not batched:
        for seq in seqs:
            list(decode_alone(seq))
        return seqs
    batch = DecodeBatch(shared_prefix_check=False, run_ahead=True, alone_on_own_caches=True)
    for seq in seqs:
        while seq.prefill_step() is None:
            pass
        batch.add(seq)
    while len(batch):
        batch.step_once()
        for seq in reversed([s for s in batch.members if s.finish_reason]):
            batch.remove(seq)
    return seqs


def test_a_padded_batch_decodes_through_the_kernel_as_each_row_alone(kernel_calls) -> None:
    lm = tiny("tiny-llama", bits=None)
    alone = _decode(lm, batched=False)
    lm.padded_decode_kernel = True
    try:
        together = _decode(lm, batched=True)
    finally:
        lm.padded_decode_kernel = False
    layers = len(lm.model.layers)
    assert len(kernel_calls) >= layers and len(kernel_calls) % layers == 0  # every layer of every padded step
    lengths = [len(s.token_ids) - len(s.generated) for s in together]
    longest = max(lengths)
    assert kernel_calls[0] == [longest - n for n in lengths]  # each row's first key: its padding
    for a, b in zip(alone, together, strict=True):
        assert_decoded_alike(a, b, lm.vocab_limit, FLOAT_TOL)


def test_rows_of_one_length_and_prefill_passes_keep_mlxs_own_kernels(kernel_calls) -> None:
    lm = tiny("tiny-llama", bits=None)
    lm.padded_decode_kernel = True
    try:
        _decode(lm, batched=True, prompts=[PROMPTS[0]] * 2, max_tokens=4)
    finally:
        lm.padded_decode_kernel = False
    assert kernel_calls == []  # no padding, no mask: MLX's vector kernel; prefill chunks: many queries


def test_the_setting_reaches_the_profile_on_cuda_only() -> None:
    on_cuda = decide_profile(device="gpu", backend="cuda", padded_decode_kernel=True)
    assert on_cuda.padded_decode_kernel and "padded decode kernel" in on_cuda.line()
    assert not decide_profile(device="gpu", backend="cuda").padded_decode_kernel  # off unless set
    assert not decide_profile(device="gpu", backend="metal", padded_decode_kernel=True).padded_decode_kernel
    assert not decide_profile(device="cpu", backend="cpu", profile="gpu", padded_decode_kernel=True).padded_decode_kernel
    assert not padded_decode.available()  # this CPU: the kernel is never built here


def test_the_kernel_refuses_what_it_does_not_compute() -> None:
    q = mx.zeros((2, 4, 2, 64))  # two queries a row
    with pytest.raises(ValueError, match="one query a row"):
        padded_decode.padded_decode_attention(q, mx.zeros((2, 2, 8, 64)), mx.zeros((2, 2, 8, 64)), scale=0.125,
                                              starts=mx.array([0, 3], dtype=mx.int32))


@pytest.mark.skipif(not padded_decode.available(), reason="the kernel is CUDA's: run on a GPU (benches/gpu_session.sh)")
@pytest.mark.parametrize("dim", padded_decode.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_on_cuda_the_kernel_is_mlxs_masked_attention(dim: int, dtype: mx.Dtype) -> None:
    """The real kernel against MLX's attention with the padding mask, keys read from a slice of a longer
    buffer as a batch cache hands them over; a row with no padding and one with a single key included."""
    mx.random.seed(3)
    rows, heads, kv_heads, length = 5, 8, 2, 300
    pads = [0, 17, 299, 120, 64]
    q = mx.random.normal((rows, heads, 1, dim)).astype(dtype)
    k, v = (mx.random.normal((rows, kv_heads, length + 40, dim)).astype(dtype) for _ in range(2))
    keys, values = k[:, :, :length], v[:, :, :length]
    starts = mx.array(pads, dtype=mx.int32)
    ours = padded_decode.padded_decode_attention(q, keys, values, scale=dim**-0.5, starts=starts)
    theirs = _what_the_kernel_computes(q, keys, values, scale=dim**-0.5, starts=starts)
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2
    assert ours.shape == theirs.shape and ours.dtype == dtype
    assert mx.abs(ours.astype(mx.float32) - theirs.astype(mx.float32)).max().item() < tolerance
