"""ds4.kernels.topk (the decode indexer's top-k) vs its twin, a stable descending sort: the same indices in
the same order, on scores full of ties, -inf, signed zeros, subnormals and huge values; one round (n <= C)
and several (n > C, chunk size shrunk so the interpreter stays quick)."""

from __future__ import annotations

import _kernel_env  # noqa: F401  (interpreter / GPU setup; skips this module in the plain CPU run)
import pytest
import torch
from _kernel_env import CUDA, DEVICE

from ds4.kernels import ref, topk


def _scores(B: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.round(torch.randn(B, n, generator=g) * 3) / 2  # quantized: many ties
    s[torch.rand(B, n, generator=g) < 0.2] = float("-inf")
    s[torch.rand(B, n, generator=g) < 0.1] = -0.0
    s[:, :4] = torch.tensor([1e-40, -1e-40, 3.4e38, -3.4e38])
    return s


@pytest.mark.parametrize(
    ("B", "n", "k", "chunk"),
    [(1, 64, 16, 4096), (3, 100, 32, 4096), (2, 700, 8, 64), (2, 1000, 64, 128), (1, 32, 32, 4096)],
    ids=["one", "pad", "rounds-3", "rounds-2", "k=n"],
)
def test_top_rows_equals_stable_sort(monkeypatch, B: int, n: int, k: int, chunk: int) -> None:
    monkeypatch.setattr(topk, "TOPK_CHUNK", chunk)
    s = _scores(B, n, seed=n + k).to(DEVICE)
    got = topk.top_rows(s, k)
    assert got.dtype == torch.int64 and got.shape == (B, k)
    assert torch.equal(got.cpu(), ref.top_rows(s.cpu(), k))


def test_top_rows_column_slice_and_random() -> None:
    """A column slice of a wider buffer (the decode step ranks score[:, :n]) and distinct random scores."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 300, generator=g)
    s = wide.to(DEVICE)[:, :200]
    assert torch.equal(topk.top_rows(s, 64).cpu(), ref.top_rows(wide[:, :200], 64))


def test_top_rows_falls_back_and_rejects() -> None:
    s = _scores(2, 50, seed=1).to(DEVICE)
    assert not topk.supports(50, 12)  # k not a power of two: the twin
    assert torch.equal(topk.top_rows(s, 12).cpu(), ref.top_rows(s.cpu(), 12))
    with pytest.raises(ValueError, match="k <= n"):
        topk.top_rows(s, 51)
    with pytest.raises(ValueError, match="float32"):
        topk.top_rows(s.double(), 4)


@pytest.mark.parametrize(
    ("B", "n", "k", "chunk"),
    [(1, 64, 16, 4096), (3, 100, 32, 4096), (2, 700, 24, 64), (2, 1000, 64, 256), (1, 32, 32, 4096)],
    ids=["one", "pad", "chunks-11", "chunks-4", "k=n"],
)
def test_select_rows_is_the_sorts_set(monkeypatch, B: int, n: int, k: int, chunk: int) -> None:
    """The radix select (select_rows): the stable sort's top-k indices (ties to the lower index), in index
    order, in registers (n <= chunk) and streamed in chunks (n > chunk: the equal ones' ranks carried)."""
    monkeypatch.setattr(topk, "SELECT_CHUNK", chunk)
    monkeypatch.setattr(topk, "SELECT_REG_MAX", chunk)  # rows past one chunk streamed
    s = _scores(B, n, seed=2 * n + k).to(DEVICE)
    got = topk.select_rows(s, k)
    assert got.dtype == torch.int64 and got.shape == (B, k)
    assert torch.equal(got.cpu(), ref.top_rows(s.cpu(), k).sort(dim=-1).values)


def test_select_rows_ties_cross_chunks(monkeypatch) -> None:
    """Every score equal: the k lowest indices, though they span chunks; a slice of a wider row; random."""
    monkeypatch.setattr(topk, "SELECT_CHUNK", 32)
    monkeypatch.setattr(topk, "SELECT_REG_MAX", 32)
    s = torch.zeros(2, 200, device=DEVICE)
    assert torch.equal(topk.select_rows(s, 70).cpu(), torch.arange(70).expand(2, 70))
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(3, 300, generator=g)
    got = topk.select_rows(wide.to(DEVICE)[:, :250], 40)
    assert torch.equal(got.cpu(), ref.top_rows(wide[:, :250], 40).sort(dim=-1).values)
    with pytest.raises(ValueError, match="k <= n"):
        topk.select_rows(s, 201)


DIGITS = {"d8": topk.WIDE_DIGITS_8, "d11": topk.WIDE_DIGITS_11}


def _d11_on_the_gpu(digits, case: str) -> None:
    """The 11-bit digits (off since session 21; env DS4_WIDE_DIGITS=11) take 2,048-bin histograms, slow under
    the interpreter: there they run the ragged case alone (several chunks a row, ties across them); every
    case on the GPU."""
    if digits is topk.WIDE_DIGITS_11 and not CUDA and case != "ragged":
        pytest.skip("11-bit digits: only the ragged case under the interpreter (all on the GPU)")


@pytest.mark.parametrize("digits", list(DIGITS.values()), ids=list(DIGITS))
@pytest.mark.parametrize(
    ("B", "n", "k", "programs"),
    [(1, 300, 16, 4), (2, 600, 100, 4), (1, 256, 64, 8), (1, 64, 64, 4)],
    ids=["ragged", "rows-2", "programs-4", "k=n"],
)
def test_select_rows_wide_is_the_sorts_set(monkeypatch, B: int, n: int, k: int, programs: int, digits):
    """The select with several programs a row (select_rows_wide; chunks shrunk so that a row spans up to 4
    programs), at 8-bit digits (4 passes) and at 11 / 11 / 10: the stable sort's top-k indices in index
    order, on tie-heavy scores (equal ones split across chunks: each chunk's share of the taken ones) and on
    distinct random ones."""
    _d11_on_the_gpu(digits, "ragged" if (B, n, k, programs) == (1, 300, 16, 4) else "other")
    monkeypatch.setattr(topk, "WIDE_DIGITS", digits)
    monkeypatch.setattr(topk, "WIDE_MIN_CHUNK", 64)
    monkeypatch.setattr(topk, "WIDE_PROGRAMS", programs)
    C, G = topk.wide_plan(n)
    assert C * G >= n and (G > 1 or n <= 64)  # several programs a row, except for the one-chunk case
    s = _scores(B, n, seed=3 * n + k).to(DEVICE)
    got = topk.select_rows_wide(s, k)
    assert got.dtype == torch.int64 and got.shape == (B, k)
    assert torch.equal(got.cpu(), ref.top_rows(s.cpu(), k).sort(dim=-1).values)
    r = torch.randn(B, n, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    assert torch.equal(topk.select_rows_wide(r, k).cpu(), ref.top_rows(r.cpu(), k).sort(dim=-1).values)


@pytest.mark.parametrize("digits", list(DIGITS.values()), ids=list(DIGITS))
def test_select_rows_wide_all_equal_and_bounds(monkeypatch, digits) -> None:
    """Every score equal across 4 chunks: the k lowest indices; a column slice; n past WIDE_MAX refused."""
    _d11_on_the_gpu(digits, "all equal")
    monkeypatch.setattr(topk, "WIDE_DIGITS", digits)
    monkeypatch.setattr(topk, "WIDE_MIN_CHUNK", 64)
    monkeypatch.setattr(topk, "WIDE_PROGRAMS", 4)
    s = torch.zeros(1, 256, device=DEVICE)
    assert torch.equal(topk.select_rows_wide(s, 150).cpu(), torch.arange(150)[None])
    s[0, 200:210] = 1.0  # above the threshold in the last chunk, after three chunks of equal ones
    want = torch.cat([torch.arange(40), torch.arange(200, 210)])[None]
    assert torch.equal(topk.select_rows_wide(s, 50).cpu(), want)
    wide = torch.randn(1, 300, generator=torch.Generator().manual_seed(8))
    got = topk.select_rows_wide(wide.to(DEVICE)[:, :200], 30)
    assert torch.equal(got.cpu(), ref.top_rows(wide[:, :200], 30).sort(dim=-1).values)
    monkeypatch.setattr(topk, "WIDE_MAX", 100)
    with pytest.raises(ValueError, match="n <= 100"):
        topk.select_rows_wide(s, 8)


BAD_DIGITS = [((24, 8), (16, 8), (8, 8)), ((20, 12), (8, 12), (0, 8)), ((24, 8), (0, 24)), ((24, 8), (8, 8))]


@pytest.mark.parametrize("digits", BAD_DIGITS, ids=["short", "12-bit", "24-bit", "gap"])
def test_select_rows_wide_refuses_digits_that_do_not_tile_the_bits(monkeypatch, digits) -> None:
    monkeypatch.setattr(topk, "WIDE_DIGITS", digits)
    with pytest.raises(ValueError, match="digits must"):
        topk.select_rows_wide(torch.zeros(1, 100, device=DEVICE), 8)


def test_decode_takes_the_select_for_rows_in_registers(monkeypatch) -> None:
    """layer._indexer_picker: the select up to INDEXER_SELECT_MAX scores a row, the wide select past it up to
    INDEXER_WIDE_MAX (and never past topk.WIDE_MAX), the sort past that or with both off."""
    from ds4.model.cuda import layer

    monkeypatch.setattr(layer, "INDEXER_WIDE", True)
    monkeypatch.setattr(layer, "INDEXER_WIDE_MAX", 20480)
    assert layer._indexer_picker(layer.INDEXER_SELECT_MAX) is topk.select_rows
    assert layer._indexer_picker(layer.INDEXER_SELECT_MAX + 1) is topk.select_rows_wide
    assert layer._indexer_picker(20480) is topk.select_rows_wide
    assert layer._indexer_picker(20481) is layer._top_rows
    monkeypatch.setattr(layer, "INDEXER_WIDE_MAX", 1 << 30)
    assert layer._indexer_picker(topk.WIDE_MAX) is topk.select_rows_wide
    assert layer._indexer_picker(topk.WIDE_MAX + 1) is layer._top_rows
    monkeypatch.setattr(layer, "INDEXER_WIDE", False)
    assert layer._indexer_picker(layer.INDEXER_SELECT_MAX + 1) is layer._top_rows
    monkeypatch.setattr(layer, "INDEXER_SELECT", False)
    assert layer._indexer_picker(64) is layer._top_rows
