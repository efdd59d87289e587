"""Short passes' attention in one kernel (``short_attention_kernel``, CUDA; issue 33).

The kernel itself runs on CUDA only: the device tests at the end compare it with MLX's masked
attention there, and ``python -m benches gpu_probe``'s batch-attention rows time it. Here, on the CPU,
the kernel is replaced by what it must compute (MLX's attention with the causal mask from each row's
first key), and the tests hold the rest: which passes reach it and with which first keys, that turns
decoded through it (a padded batch's steps, a hot turn's message, a group's joint prefill) reply as
they do without it, and that the setting reaches the profile only on CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest
from agreement import assert_decoded_alike
from conftest import tiny

from runtime.backend import decide_profile
from runtime.execution.batch_prefill import choose_group, prefill_together
from runtime.execution.decode_batch import DecodeBatch
from runtime.execution.generate import decode_alone, generate
from runtime.execution.sequence import Sequence, SequenceSampling
from runtime.kv import short_attention

FLOAT_TOL = 2e-3
PROMPTS = ["The harbour master kept a ledger of ships. " * 3, "Once upon a time in a quiet town, " * 5,
           "Numbers: one two three four five six. " * 2, "A list of fruits and their colours. " * 4]


class Call(NamedTuple):
    rows: int
    queries: int
    starts: list[int]


def _recorded(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Call]:
    """Each call to the module's kernel ``name``, the kernel replaced by its definition."""
    calls: list[Call] = []

    def kernel(queries, keys, values, *, scale, starts):
        calls.append(Call(queries.shape[0], queries.shape[2], starts.tolist()))
        return short_attention.reference(queries, keys, values, scale=scale, starts=starts)

    monkeypatch.setattr(short_attention, name, kernel)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    """Each call to the one-pass kernel."""
    return _recorded(monkeypatch, "short_attention")


@pytest.fixture
def long_calls(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    """Each call to the long-keys road, its two passes."""
    return _recorded(monkeypatch, "long_attention")


@pytest.fixture
def lm():
    model = tiny("tiny-llama", bits=None)
    yield model
    model.short_attention_kernel, model.long_keys_kernel, model.plain_attention_queries = False, False, 0


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
    batch = _gpu_policy_batch()
    for seq in seqs:
        while seq.prefill_step() is None:
            pass
        batch.add(seq)
    _until_done(batch)
    return seqs


def _gpu_policy_batch() -> DecodeBatch:
    return DecodeBatch(shared_prefix_check=False, run_ahead=True, alone_on_own_caches=True)


def _until_done(batch: DecodeBatch) -> None:
    """Step ``batch`` until every row finished, removing the finished rows as the engine does (the last first)."""
    while len(batch):
        batch.step_once()
        for seq in reversed([s for s in batch.members if s.finish_reason]):
            batch.remove(seq)


def test_a_padded_batch_decodes_through_the_kernel_as_each_row_alone(lm, kernel_calls) -> None:
    alone = _decode(lm, batched=False)
    lm.short_attention_kernel = True
    together = _decode(lm, batched=True)
    layers = len(lm.model.layers)
    assert kernel_calls and all(c.queries == 1 and c.rows > 1 for c in kernel_calls)  # no pass is short (plain 0)
    assert len(kernel_calls) % layers == 0  # every layer of every padded step
    lengths = [len(s.token_ids) - len(s.generated) for s in together]
    assert kernel_calls[0].starts == [max(lengths) - n for n in lengths]  # each row's first key: its padding
    for a, b in zip(alone, together, strict=True):
        assert_decoded_alike(a, b, lm.vocab_limit, FLOAT_TOL)


def _second_turns(lm) -> list[tuple[str, object]]:
    """Each topic's first turn (its parked cache) and the second turn's prompt: a short new message."""
    out = []
    for topic, follow_up in (("the old mill", "What next?"), ("a lighthouse", "And then what happened?"),
                             ("the baker's secret", "Why?")):
        first = [{"role": "user", "content": f"Tell me about {topic}."}]
        done = generate(lm, lm.render(first), None, SequenceSampling(max_tokens=6), attention="at-rest")
        second = first + [{"role": "assistant", "content": done.reply}, {"role": "user", "content": follow_up}]
        out.append((lm.render(second), done.cache))
    return out


def _hot_and_joined(lm, turns) -> list[Sequence]:
    """The first turn's second prompt prefilled alone over its cache (a hot turn), the others together."""
    params = SequenceSampling(max_tokens=6)
    rows = [Sequence(lm, prompt, cache, params) for prompt, cache in turns]
    for seq in rows:
        seq.logits_trace = []
    while rows[0].prefill_step() is None:
        pass
    group = choose_group({i: s for i, s in enumerate(rows) if i > 0})
    assert sorted(group) == [1, 2]
    grouped = [rows[i] for i in group]
    _, caches = prefill_together(grouped, [group[i] for i in group])
    batch = _gpu_policy_batch()
    batch.add(rows[0])
    batch.add_group(grouped, caches)
    _until_done(batch)
    return rows


def test_a_hot_turns_message_and_a_groups_joint_prefill_go_through_the_kernel(lm, kernel_calls) -> None:
    lm.plain_attention_queries = 64  # the GPU policy's short passes
    turns = _second_turns(lm)
    before = _hot_and_joined(lm, turns)
    kernel_calls.clear()
    lm.short_attention_kernel = True
    after = _hot_and_joined(lm, _second_turns(lm))
    short = [c for c in kernel_calls if c.queries > 1]
    assert any(c.rows == 1 and c.starts == [0] for c in short)  # the hot turn's message over its own cache
    assert any(c.rows == 2 for c in short)  # the group's joint pass, its rows lined up from their first keys
    assert any(c.rows == 3 and c.queries == 1 and max(c.starts) > 0 for c in kernel_calls)  # then the padded steps
    for a, b in zip(before, after, strict=True):
        assert_decoded_alike(a, b, lm.vocab_limit, FLOAT_TOL)


def test_a_pass_over_more_keys_than_the_kernel_takes_keeps_plain_operations(lm, kernel_calls, monkeypatch) -> None:
    """Past ``SHORT_PASS_KEYS`` keys a short pass attends with plain operations (H200 run 6: the kernel's 16 queries
    over 16,000 keys took 1.31 ms a layer against plain operations' 0.51-0.58); a padded step's one query stays."""
    lm.plain_attention_queries, lm.short_attention_kernel = 64, True
    monkeypatch.setattr(short_attention, "SHORT_PASS_KEYS", 16)  # the tiny turns' caches hold more than 16 keys
    _hot_and_joined(lm, _second_turns(lm))
    assert [c for c in kernel_calls if c.queries > 1] == []
    assert any(c.queries == 1 and max(c.starts) > 0 for c in kernel_calls)


def test_where_the_long_keys_road_is_on_long_short_passes_take_it_and_reply_as_before(
        lm, kernel_calls, long_calls, monkeypatch) -> None:
    """Past ``SHORT_PASS_KEYS`` keys (here 16: the tiny turns' caches hold more) a short pass goes through the
    two-pass kernel where the load's check held it, instead of plain operations; a padded step's one query keeps
    the one-pass kernel. The replies are the plain road's."""
    lm.plain_attention_queries = 64
    before = _hot_and_joined(lm, _second_turns(lm))
    monkeypatch.setattr(short_attention, "SHORT_PASS_KEYS", 16)
    lm.short_attention_kernel, lm.long_keys_kernel = True, True
    after = _hot_and_joined(lm, _second_turns(lm))
    assert any(c.rows == 1 and c.queries > 1 and c.starts == [0] for c in long_calls)  # the hot turn's message
    assert any(c.rows == 2 and c.queries > 1 for c in long_calls)  # the group's joint pass
    assert all(c.queries > 1 for c in long_calls)
    assert kernel_calls and all(c.queries == 1 and max(c.starts) > 0 for c in kernel_calls)  # the padded steps
    for a, b in zip(before, after, strict=True):
        assert_decoded_alike(a, b, lm.vocab_limit, FLOAT_TOL)


def test_the_long_keys_road_takes_the_groups_and_scratch_it_allows() -> None:
    def takes(rows: int, heads: int, kv_heads: int, queries: int, dim: int = 64) -> bool:
        q, k = mx.zeros((rows, heads, queries, dim)), mx.zeros((rows, kv_heads, 1, dim))
        return short_attention.takes_long_keys(q, k)

    assert takes(1, 32, 8, 64, dim=128)  # a 3B-like hot turn's longest message: 33.6 MB of partial sums
    assert not takes(8, 32, 8, 64, dim=128)  # eight such rows joining: 268 MB, over the scratch bound
    assert takes(1, 16, 2, 5) and not takes(1, 18, 2, 5)  # 8 query heads a key head, not 9
    assert not takes(1, 12, 8, 5)  # not a whole group a key head


def _two_passes(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, starts: list[int]) -> np.ndarray:
    """:func:`short_attention.long_attention`'s arithmetic in NumPy, block for block and warp for warp: a (row, query)'s
    keys from the row's first to its causal bound dealt to ``SPLITS`` blocks of 8 warps, every 256th key a warp,
    each warp's scores in base 2 with its own max, the warps joined in their block, the blocks in the second pass."""
    splits, warps = short_attention.SPLITS, 8
    rows, heads, length, dim = q.shape
    group, keys = heads // k.shape[1], k.shape[2]
    floor = np.finfo(np.float32).min  # an empty warp's or block's max, as the kernel's Limits<U>::finite_min()
    out = np.zeros(q.shape, np.float32)
    for b, h, i in np.ndindex(rows, heads, length):
        query = q[b, h, i] * scale * np.log2(np.e)
        maxs, sums, partials = [], [], []
        for split in range(splits):
            warp_max, warp_sum, warp_out = [], [], []
            for w in range(warps):
                ks = np.arange(starts[b] + split * warps + w, keys - length + i + 1, splits * warps)
                scores = k[b, h // group, ks] @ query
                top = scores.max() if len(ks) else floor
                e = np.exp2(scores - top)
                warp_max.append(top), warp_sum.append(e.sum()), warp_out.append(e @ v[b, h // group, ks])
            block_max = max(warp_max)
            own = np.exp2(np.array(warp_max) - block_max)
            maxs.append(block_max), sums.append(own @ warp_sum), partials.append(own @ np.array(warp_out))
        factor = np.exp2(np.array(maxs) - max(maxs))
        total = factor @ sums
        out[b, h, i] = factor @ np.array(partials) / total if total else 0
    return out


@pytest.mark.parametrize(("queries", "group"), [(1, 4), (5, 3)])
def test_the_two_passes_deal_every_key_once_and_join_to_the_attention(queries: int, group: int) -> None:
    """The design the CUDA source follows, held to MLX's masked attention on the CPU: rows with no padding, a split's
    worth, most of the keys and all but one (its first query sees one key), so some warps and blocks are empty."""
    rng = np.random.default_rng(0)
    size = 1300
    q = rng.standard_normal((4, 2 * group, queries, 64)).astype(np.float32)
    k, v = (rng.standard_normal((4, 2, size, 64)).astype(np.float32) for _ in range(2))
    starts = [0, 8 * short_attention.SPLITS + 3, size - 200, size - queries]
    ours = _two_passes(q, k, v, 0.125, starts)
    theirs = short_attention.reference(mx.array(q), mx.array(k), mx.array(v), scale=0.125,
                                       starts=mx.array(starts, dtype=mx.int32))
    np.testing.assert_allclose(ours, np.array(theirs), atol=2e-6)


def test_the_long_keys_check_holds_each_head_size_and_group_to_the_attention(monkeypatch) -> None:
    calls: list[tuple[int, int, int, int]] = []

    def kernel(queries, keys, values, *, scale, starts):
        calls.append((queries.shape[-1], queries.shape[1] // keys.shape[1], queries.shape[2], keys.shape[2]))
        return short_attention.reference(queries, keys, values, scale=scale, starts=starts)

    monkeypatch.setattr(short_attention, "long_attention", kernel)
    assert short_attention.check_long_keys(mx.float16, {64, 80}, {4, 9}) is None  # 80 and 9: not the kernel's
    assert calls == [(64, 4, 1, 1300), (64, 4, 5, 1300)]
    monkeypatch.setattr(short_attention, "long_attention", lambda q, k, v, *, scale, starts: q * 0)
    assert "off MLX's attention" in short_attention.check_long_keys(mx.float32, {64}, {1})
    monkeypatch.setattr(short_attention, "long_attention", lambda q, k, v, *, scale, starts: 1 / 0)
    assert short_attention.check_long_keys(mx.float32, {64}, {1}).startswith("ZeroDivisionError")
    # a model the kernel would take no call of keeps it off (the profile then does not name it)
    problem = short_attention.check_long_keys(mx.float32, {64}, {9})
    assert "no head size of [64] with a query head group of [9]" in problem
    assert "no head size of [80]" in short_attention.check_long_keys(mx.float32, {80}, {4})


def test_rows_of_one_length_and_long_passes_keep_mlxs_own_kernels(lm, kernel_calls) -> None:
    lm.short_attention_kernel, lm.plain_attention_queries = True, 8
    _decode(lm, batched=True, prompts=[PROMPTS[0]] * 2, max_tokens=4)
    assert kernel_calls == []  # no padding: MLX's vector kernel; prompts of 30+ tokens: more queries than short


def test_the_setting_reaches_the_profile_on_cuda_only() -> None:
    on_cuda = decide_profile(device="gpu", backend="cuda", short_attention_kernel=True)
    assert on_cuda.short_attention_kernel and "short attention kernel" in on_cuda.line()
    assert decide_profile(device="gpu", backend="cuda").short_attention_kernel  # the GPU policy's default
    assert not decide_profile(device="gpu", backend="cuda", short_attention_kernel=False).short_attention_kernel
    assert not decide_profile(device="gpu", backend="cuda", profile="cpu").short_attention_kernel
    assert not decide_profile(device="gpu", backend="metal", short_attention_kernel=True).short_attention_kernel
    assert not decide_profile(device="cpu", backend="cpu", profile="gpu",
                              short_attention_kernel=True).short_attention_kernel
    # Built only where MLX runs CUDA kernels: never on a CPU (H200 run 6: this line asked "never" of a GPU too)
    assert short_attention.available() == (mx.default_device() == mx.gpu and mx.cuda.is_available())


def test_the_kernel_refuses_what_it_does_not_compute() -> None:
    keys = mx.zeros((2, 2, 80, 64))
    starts = mx.array([0, 3], dtype=mx.int32)
    with pytest.raises(ValueError, match="queries a row"):  # a prefill chunk's many queries
        short_attention.short_attention(mx.zeros((2, 4, 65, 64)), keys, keys, scale=0.125, starts=starts)
    with pytest.raises(ValueError, match="head size"):
        short_attention.short_attention(mx.zeros((2, 4, 1, 80)), keys, keys, scale=0.125, starts=starts)


@pytest.mark.skipif(not short_attention.available(), reason="the kernel is CUDA's: run on a GPU (benches/gpu_session.sh)")
@pytest.mark.parametrize("queries", [1, 5, 16])
@pytest.mark.parametrize("dim", short_attention.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_on_cuda_the_kernel_is_mlxs_masked_attention(queries: int, dim: int, dtype: mx.Dtype) -> None:
    """The real kernel against MLX's attention with the causal mask from each row's first key, keys read
    from a slice of a longer buffer as a cache hands them over; a row with no padding and one whose
    first query sees a single key included."""
    mx.random.seed(3)
    _assert_masked_attention(short_attention.short_attention, queries=queries, heads=8, kv_heads=2, length=300,
                             room=40, dim=dim, dtype=dtype, pads=[0, 17, 300 - queries, 120, 64])


def _assert_masked_attention(kernel, *, queries: int, heads: int, kv_heads: int, length: int, room: int, dim: int,
                             dtype: mx.Dtype, pads: list[int]) -> None:
    """``kernel`` against MLX's attention with the causal mask from each row's first key (``pads``), keys and values
    the first ``length`` of a buffer ``room`` longer, in ``dtype`` (within its rounding)."""
    q = mx.random.normal((len(pads), heads, queries, dim)).astype(dtype)
    k, v = (mx.random.normal((len(pads), kv_heads, length + room, dim)).astype(dtype) for _ in range(2))
    keys, values = k[:, :, :length], v[:, :, :length]
    starts = mx.array(pads, dtype=mx.int32)
    ours = kernel(q, keys, values, scale=dim**-0.5, starts=starts)
    theirs = short_attention.reference(q, keys, values, scale=dim**-0.5, starts=starts)
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2
    assert ours.shape == theirs.shape and ours.dtype == dtype
    assert mx.abs(ours.astype(mx.float32) - theirs.astype(mx.float32)).max().item() < tolerance


def test_a_load_checks_the_kernel_for_the_models_dtype_and_head_sizes_and_leaves_it_off_when_it_fails(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """MLX compiles a custom kernel at its first call (H200 run 6: 2.1 s): a load makes that call, so a server's
    first batch does not wait for it, and holds the kernel to MLX's masked attention at each head size it takes;
    a kernel that does not give it (or does not build) is reported in one line and not used."""
    from runtime.model.loaded import load_model
    from conftest import models_dir

    calls: list[tuple[int, int, mx.Dtype]] = []

    def kernel(queries, keys, values, *, scale, starts):
        calls.append((queries.shape[-1], queries.shape[2], queries.dtype))
        return short_attention.reference(queries, keys, values, scale=scale, starts=starts)

    monkeypatch.setattr(short_attention, "short_attention", kernel)
    assert short_attention.check(mx.bfloat16, {64, 80, 128}) is None
    assert calls == [(64, 1, mx.bfloat16), (64, 5, mx.bfloat16), (128, 1, mx.bfloat16), (128, 5, mx.bfloat16)]
    monkeypatch.setattr(short_attention, "short_attention", lambda q, k, v, *, scale, starts: q)
    assert "off MLX's attention" in short_attention.check(mx.float32, {64})
    assert "no head size of [80] is one it takes" in short_attention.check(mx.float32, {80})
    monkeypatch.setattr(short_attention, "available", lambda: True)
    for problem, long_problem in ((None, None), (None, "off by 0.5"), ("no kernel image", None)):
        checked: list[tuple[mx.Dtype, set[int]]] = []
        long_checked: list[tuple[mx.Dtype, set[int], set[int]]] = []
        monkeypatch.setattr(short_attention, "check", lambda dtype, dims: checked.append((dtype, set(dims))) or problem)
        monkeypatch.setattr(short_attention, "check_long_keys",
                            lambda dtype, dims, groups: long_checked.append((dtype, set(dims), set(groups)))
                            or long_problem)
        caplog.clear()
        with caplog.at_level("INFO", logger="kvmem"):
            lm = load_model("tiny-llama", models_dir=models_dir(), numpy_attention=False, plain_attention_queries=64,
                            short_attention_kernel=True)
        assert ("in two passes over more than 2048 keys" in caplog.text) == lm.long_keys_kernel  # a start says so
        dims = {layer.k_head_dim for layer in lm.spec.layers}
        assert checked == [(lm.float_dtype, dims)]
        assert lm.short_attention_kernel == (problem is None)
        # the long-keys road is checked only once the one-pass kernel holds, for the model's query head group
        # (tiny-llama: 4 query heads, 2 key heads), and a failure there leaves the one-pass road on
        assert long_checked == ([(lm.float_dtype, dims, {2})] if problem is None else [])
        assert lm.long_keys_kernel == (problem is None and long_problem is None)
        if problem:
            assert "short attention kernel is off, its check at load failed: no kernel image" in caplog.text
        elif long_problem:
            assert "attention kernel over long keys is off, its check at load failed: off by 0.5" in caplog.text
    checked.clear()
    load_model("tiny-llama", models_dir=models_dir(), numpy_attention=False, plain_attention_queries=64)
    assert checked == []  # the setting off: nothing built

@pytest.mark.skipif(not short_attention.available(), reason="the kernel is CUDA's: run on a GPU (benches/gpu_session.sh)")
def test_on_cuda_the_load_check_passes_for_every_dtype_and_head_size() -> None:
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        assert short_attention.check(dtype, set(short_attention.HEAD_DIMS)) is None, dtype


@pytest.mark.skipif(not short_attention.available(), reason="the kernel is CUDA's: run on a GPU (benches/gpu_session.sh)")
@pytest.mark.parametrize(("queries", "group", "dim"), [(1, 4, 64), (13, 3, 128), (64, 1, 96), (5, 8, 128)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_on_cuda_the_two_passes_are_mlxs_masked_attention(queries: int, group: int, dim: int, dtype: mx.Dtype) -> None:
    """The long-keys road against MLX's attention with the causal mask from each row's first key, over 5,000 keys read
    from a slice of a longer buffer: a row with no padding, padded rows, one whose first query sees a single key.
    A few shapes (a 1B's, a 3B's, the widest group): MLX compiles each (dtype, head size, group) at its first call,
    about 2 s each."""
    mx.random.seed(5)
    _assert_masked_attention(short_attention.long_attention, queries=queries, heads=2 * group, kv_heads=2,
                             length=5000, room=256, dim=dim, dtype=dtype, pads=[0, 259, 4100, 5000 - queries])


@pytest.mark.skipif(not short_attention.available(), reason="the kernel is CUDA's: run on a GPU (benches/gpu_session.sh)")
def test_on_cuda_the_long_keys_check_passes_for_every_dtype() -> None:
    """A 1B's head size and group in each dtype (float16: the needle model's), and a 3B's in bfloat16."""
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        assert short_attention.check_long_keys(dtype, {64}, {4}) is None, dtype
    assert short_attention.check_long_keys(mx.bfloat16, {128}, {3}) is None
