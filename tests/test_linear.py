"""The model's matrix products (`replica.model.linear.Linear`) keep their answers on every path:
oneDNN's packed product in fp32 and bf16, the skinny kernel's dense product (fp32, and bf16 with
AVX512_BF16) and its weight-only int8 product against F.linear; each faster path serves up to
the row count measured here (cached on disk); where the kernel cannot serve, oneDNN does."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from replica.model.linear import Linear, can_pack


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_bf16_packed_and_int8_products_match_fp32(rows):
    """Each path's product is within its dtype's rounding of the fp32 product; int8 serves only
    steps of at most int8_rows rows."""
    torch.manual_seed(0)
    w, b, x = torch.randn(200, 96) * 0.05, torch.randn(200), torch.randn(rows, 96)
    ref = F.linear(x, w, b)
    fp32 = Linear(w, b)
    bf16 = Linear(w.bfloat16(), b.bfloat16())
    int8 = Linear(w.bfloat16(), b.bfloat16(), int8_rows=3, measure_int8=False)
    assert fp32.packed and bf16.packed == can_pack(w.bfloat16())
    torch.testing.assert_close(fp32(x), ref, rtol=1e-4, atol=1e-4)
    scale = ref.abs().max().item()
    assert (bf16(x.bfloat16()).float() - ref).abs().max().item() < 0.03 * scale
    got = int8(x.bfloat16()).float()
    assert (got - ref).abs().max().item() < 0.05 * scale
    # int8 rounds differently from bf16, so its result differs exactly where it is used
    assert torch.equal(got, bf16(x.bfloat16()).float()) == (rows > 3)


def _skinny_kernel():
    from replica.kernels import skinny_matmul

    if not shutil.which("c++"):
        pytest.skip("no C++ compiler: the kernel is not built and oneDNN and torch's operators serve")
    assert skinny_matmul.available("cpu")
    return skinny_matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 11])
def test_int8_kernel_equals_the_dequantized_product(dtype, rows):
    """The int8 kernel computes x (q * scale)^T + bias + residual for any row count and a K that
    is not a multiple of its vector stride; a shape mismatch is refused by name."""
    from replica.model.linear import quantize_int8

    skinny_matmul = _skinny_kernel()
    torch.manual_seed(0)
    w, bias = torch.randn(70, 100) * 0.05, torch.randn(70)
    x, residual = torch.randn(rows, 100).to(dtype), torch.randn(rows, 70).to(dtype)
    q, scales = quantize_int8(w)
    want = x.float() @ (q.float() * scales[:, None]).T + bias + residual.float()
    got = skinny_matmul.int8_linear(x, q, scales, bias, residual)
    assert got.dtype == dtype and got.shape == (rows, 70)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] against weight \\[N, K\\]"):
        skinny_matmul.int8_linear(x[:, :99], q, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, 17))
def test_dense_kernel_equals_f_linear(dtype, rows):
    """The dense kernel is F.linear in fp32 (plus bias and residual where given) for every step
    size it serves, with N and K that fill no block or vector (N = 13: one 8-row block, one
    4-row, one single; N = 70 and K = 577, 101). fp32: within fp32 summation order (1e-5 of
    the sum's scale). bf16: products of bf16 values are exact in fp32, so the result is the fp32
    sum rounded once to bf16, within half a bf16 step (at most 2^-8 of the value) and summation order."""
    skinny_matmul = _skinny_kernel()
    if dtype not in skinny_matmul.dense_dtypes():
        pytest.skip("no AVX512_BF16 here: bf16 weights keep to oneDNN")
    torch.manual_seed(rows)
    for n, k in ((13, 577), (70, 101), (64, 576)):
        w, bias = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
        x, residual = torch.randn(rows, k).to(dtype), torch.randn(rows, n).to(dtype)
        for b, r in itertools.product((None, bias), (None, residual)):
            want = F.linear(x.float(), w.float(), None if b is None else b.float())
            want = want if r is None else want + r.float()
            got = skinny_matmul.dense_linear(x, skinny_matmul.dense_layout(w), b, r)
            assert got.dtype == dtype and got.shape == (rows, n)
            scale = k**0.5
            bound = 1e-5 * scale if dtype == torch.float32 else 2**-8 * want.abs() + 1e-5 * scale
            assert ((got.float() - want).abs() <= bound).all(), (n, k, b is None, r is None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] against weight \\[N, K\\]"):
        skinny_matmul.dense_linear(x[:, :-1], skinny_matmul.dense_layout(w))
    with pytest.raises(RuntimeError, match="the weight's dtype"):
        skinny_matmul.dense_linear(x.half(), skinny_matmul.dense_layout(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blocked_layout_gives_the_plain_layouts_products_bit_for_bit(dtype):
    """`dense_layout` blocks a weight whose rows fill whole 8-row blocks and whole vectors (and
    only those), and reading it blocked runs every sum in the same order as reading it plain: the
    same bits at every step size, with bias and residual."""
    skinny_matmul = _skinny_kernel()
    if dtype not in skinny_matmul.dense_dtypes():
        pytest.skip("no AVX512_BF16 here: bf16 weights keep to oneDNN")
    torch.manual_seed(0)
    assert not skinny_matmul.dense_layout(torch.randn(13, 64).to(dtype)).blocked
    assert not skinny_matmul.dense_layout(torch.randn(64, 577).to(dtype)).blocked
    for n, k in ((64, 576), (192, 1536), (8, 64)):
        w, bias = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
        blocked, plain = skinny_matmul.dense_layout(w), skinny_matmul.DenseWeight(w.contiguous(), False)
        assert blocked.blocked and blocked.data.shape == w.shape and not torch.equal(blocked.data, w)
        for rows in (1, 2, 3, 4, 5, 8, 13, 64):
            x, r = torch.randn(rows, k).to(dtype), torch.randn(rows, n).to(dtype)
            for b, res in ((None, None), (bias, r)):
                want = skinny_matmul.dense_linear(x, plain, b, res)
                assert torch.equal(skinny_matmul.dense_linear(x, blocked, b, res), want), (n, k, rows)


def test_linear_adds_the_residual_on_every_path(monkeypatch):
    """Linear(x, residual=r) is x W^T + b + r packed, plain, through the skinny kernel (taken here
    whatever this machine measures), int8, and with a bias."""
    from replica.kernels import skinny_matmul
    from replica.model import linear

    monkeypatch.setattr(linear, "crossover", lambda path, lin, fast: linear.CROSSOVER_ROWS[-1])
    torch.manual_seed(0)
    w, b, x, r = torch.randn(40, 24), torch.randn(40), torch.randn(3, 24), torch.randn(3, 40)
    paths = (Linear(w, b), Linear(w), Linear(w, b, skinny=False), Linear(w, b, pack=False))
    if shutil.which("c++"):  # the kernel is built, and serves fp32 weights on any CPU
        assert skinny_matmul.serves_dense(w) and paths[0].skinny_rows >= x.shape[0]
    for lin in (*paths, Linear(w, b, int8_rows=4, measure_int8=False)):
        plain = lin(x)
        torch.testing.assert_close(lin(x, residual=r), plain + r, rtol=1e-5, atol=1e-5)


def test_int8_rows_follow_the_crossover_measured_here(monkeypatch, tmp_path):
    """int8_rows is a bound: the copy serves up to the row count where it was measured to beat the
    dense paths on this machine, which is written to the cache and read back by the next Linear
    of that shape (so a start measures once); where it never pays, no copy is kept."""
    from replica.model import linear

    monkeypatch.setenv("SLOTSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(linear, "_CROSSOVERS", {})
    torch.manual_seed(0)
    w = torch.randn(256, 128).bfloat16()
    first = Linear(w, int8_rows=64)
    cached = json.loads((tmp_path / linear.CROSSOVER_FILE).read_text())
    key = next(k for k in cached if k.startswith("int8/"))
    assert cached[key] == first.int8_rows and first.int8_rows in (0, *linear.CROSSOVER_ROWS)
    assert (first.int8 is None) == (first.int8_rows == 0)
    for measured, bound, want in ((8, 64, 8), (8, 3, 3), (0, 64, 0)):
        (tmp_path / linear.CROSSOVER_FILE).write_text(json.dumps({**cached, key: measured}))
        monkeypatch.setattr(linear, "_CROSSOVERS", {})
        got = Linear(w, int8_rows=bound)
        assert got.int8_rows == want and (got.int8 is None) == (want == 0)
        x = torch.randn(want or 1, 128).bfloat16()
        ref = F.linear(x.float(), w.float())
        torch.testing.assert_close(got(x).float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_rows_follow_the_crossover_measured_here(monkeypatch, tmp_path, dtype):
    """The dense kernel serves steps up to the row count measured faster than oneDNN's packed
    product here, cached on disk and read back; steps above it (and every step where it never
    pays, when no copy for the kernel is kept) take the packed product; so does a step with no rows."""
    from replica.model import linear

    skinny_matmul = _skinny_kernel()
    if dtype not in skinny_matmul.dense_dtypes():
        pytest.skip("no AVX512_BF16 here: bf16 weights keep to oneDNN")
    monkeypatch.setenv("SLOTSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(linear, "_CROSSOVERS", {})
    torch.manual_seed(0)
    w, b = torch.randn(264, 96).to(dtype), torch.randn(264).to(dtype)
    first = Linear(w, b)
    cached = json.loads((tmp_path / linear.CROSSOVER_FILE).read_text())
    [(key, measured)] = cached.items()
    assert key.startswith("skinny/") and measured == first.skinny_rows in (0, *linear.CROSSOVER_ROWS)
    onednn = Linear(w, b, skinny=False)
    assert onednn.packed and onednn.skinny_rows == 0 and onednn.skinny_weight is None
    for measured in (4, 0):
        (tmp_path / linear.CROSSOVER_FILE).write_text(json.dumps({key: measured}))
        monkeypatch.setattr(linear, "_CROSSOVERS", {})
        got = Linear(w, b)
        assert got.skinny_rows == measured and (got.skinny_weight is None) == (measured == 0)
        for rows in (0, 1, 4, 5):  # a step may have no rows for a product (no sampled rows)
            x, r = torch.randn(rows, 96).to(dtype), torch.randn(rows, 264).to(dtype)
            kernel = 0 < rows <= measured
            dense = skinny_matmul.dense_layout(w)
            want = skinny_matmul.dense_linear(x, dense, b, r) if kernel else onednn(x, residual=r)
            assert torch.equal(got(x, residual=r), want), (measured, rows)


def test_linear_keeps_to_onednn_where_the_kernel_cannot_serve(monkeypatch):
    """A weight dtype the kernel has no product for (fp16), or a CPU without the instructions (no
    dtype served): no copy for the kernel, no crossover measured, oneDNN's or torch's product."""
    from replica.kernels import skinny_matmul
    from replica.model import linear

    monkeypatch.setattr(linear, "crossover", lambda *args: pytest.fail("measured a path that cannot serve"))
    torch.manual_seed(0)
    w, x = torch.randn(40, 24), torch.randn(2, 24)
    half = Linear(w.half())
    assert half.skinny_rows == 0 and half.skinny_weight is None
    torch.testing.assert_close(half(x.half()), F.linear(x.half(), w.half()))
    monkeypatch.setattr(skinny_matmul, "dense_dtypes", frozenset)
    for dtype in (torch.float32, torch.bfloat16):
        lin = Linear(w.to(dtype))
        assert lin.skinny_rows == 0 and lin.skinny_weight is None and lin.packed == can_pack(w.to(dtype))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(lin(x.to(dtype)).float(), F.linear(x, w), rtol=tol, atol=tol * 5)


def test_the_suite_measures_its_crossovers_apart_from_the_users_cache():
    """The suite's crossovers, measured on a machine it keeps busy, go to a cache folder of the
    session's own (`tests/conftest.py`), never to the user's crossover.json."""
    from replica.model import linear
    from replica.model.loader import cache_dir

    session = cache_dir()
    assert session == Path(os.environ["SLOTSERVE_TEST_CACHE"]) and session != Path.home() / ".cache" / "slotserve"
    assert not (session / linear.CROSSOVER_FILE).is_symlink()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_skinny_copies_are_one_stream_in_order_with_the_same_products(monkeypatch, dtype):
    """`gather_skinny_weights` moves the Linears' skinny copies into one buffer, each right after
    the one before it (to the cache line) in the order given, skipping a Linear without one; every
    product stays the same bit for bit, blocked and plain copies alike."""
    from replica.model import linear

    skinny_matmul = _skinny_kernel()
    if dtype not in skinny_matmul.dense_dtypes():
        pytest.skip("no AVX512_BF16 here: bf16 weights keep to oneDNN")
    monkeypatch.setattr(linear, "crossover", lambda path, lin, fast: linear.CROSSOVER_ROWS[-1])
    torch.manual_seed(0)
    shapes = ((64, 576), (13, 64), (192, 1536), (8, 64))  # (13, 64) stays plain: its rows fill no block
    linears = [Linear(torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)) for n, k in shapes]
    linears.insert(2, Linear(torch.randn(16, 64).to(dtype), skinny=False))
    xs = [torch.randn(rows, lin.shape[1]).to(dtype) for lin in linears for rows in (1, 5)]
    before = [lin(x) for lin in linears for x in xs if x.shape[1] == lin.shape[1]]
    linear.gather_skinny_weights(linears)
    held = [lin.skinny_weight.data for lin in linears if lin.skinny_weight is not None]
    assert len(held) == 4 and len({t.untyped_storage().data_ptr() for t in held}) == 1
    for a, b in zip(held, held[1:]):
        end = a.data_ptr() + a.numel() * a.element_size()
        assert end <= b.data_ptr() < end + linear._ALIGN_BYTES and b.data_ptr() % linear._ALIGN_BYTES == 0
    after = [lin(x) for lin in linears for x in xs if x.shape[1] == lin.shape[1]]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
