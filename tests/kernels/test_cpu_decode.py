"""The C decode-attention kernel (``servelab.attention.cpu_decode``) against float64.

Random shapes (rows, KV heads per row, GQA group 1-8, head sizes that take
the wide and the narrow value loop, lengths from 1 to ``cap``, result widths
past the longest length); the scores and the value product each within
float32 rounding of the float64 products; the tiled K layout against plain
indexing; argument checks; the build's fallback (no compiler, switched off).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention import cpu_decode

needs_kernel = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the kernel is not built")


def make(rows, kv_per_row, group, head_size, cap, seed):
    gen = torch.Generator().manual_seed(seed)
    heads = rows * kv_per_row
    q = torch.randn(heads, group, head_size, generator=gen)
    keys = torch.randn(heads, cap, head_size, generator=gen)
    values = torch.randn(heads, cap, head_size, generator=gen)
    lens = torch.randint(1, cap + 1, (rows,), generator=gen)
    return q, keys, values, lens


def reference_scores(q, keys, lens, width, scale):
    """float64 ``scale * q @ K^T`` ``[H, G, width]``, ``-inf`` past each row's length."""
    heads, _, _ = q.shape
    kv_per_row = heads // lens.numel()
    scores = torch.full((heads, q.shape[1], width), float("-inf"), dtype=torch.float64)
    for h in range(heads):
        n = int(lens[h // kv_per_row])
        scores[h, :, :n] = scale * q[h].double() @ keys[h, :n].double().T
    return scores


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 5), kv_per_row=st.integers(1, 3), group=st.integers(1, 8),
       head_size=st.sampled_from([16, 32, 64, 128]), tiles=st.integers(1, 6), extra=st.integers(0, 20),
       seed=st.integers(0, 2**16))
def test_kernel_matches_float64(rows, kv_per_row, group, head_size, tiles, extra, seed):
    cap = 16 * tiles
    q, keys, values, lens = make(rows, kv_per_row, group, head_size, cap, seed)
    width = min(cap, int(lens.max()) + extra)
    scale = head_size ** -0.5
    scores = cpu_decode.decode_scores(q, cpu_decode.tile_keys(keys), lens, width, scale)
    expected = reference_scores(q, keys, lens, width, scale)
    assert torch.equal(torch.isinf(scores), torch.isinf(expected))  # exactly the positions past each length
    finite = torch.isfinite(expected)
    torch.testing.assert_close(scores.double()[finite], expected[finite], rtol=1e-5, atol=1e-5)

    p = torch.softmax(scores, dim=-1)
    p_poisoned = p.clone()
    p_poisoned[~finite] = float("nan")  # columns past a length must never be read
    out = cpu_decode.decode_pv(p_poisoned, values, lens)
    kv_per = q.shape[0] // rows
    for h in range(q.shape[0]):
        n = int(lens[h // kv_per])
        torch.testing.assert_close(out[h].double(), p[h, :, :n].double() @ values[h, :n].double(),
                                   rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_is_deterministic_and_row_independent():
    q, keys, values, lens = make(3, 2, 3, 64, 48, seed=1)
    tiles = cpu_decode.tile_keys(keys)
    first = cpu_decode.decode_scores(q, tiles, lens, 48, 0.125)
    again = cpu_decode.decode_scores(q.clone(), tiles.clone(), lens, 48, 0.125)
    assert torch.equal(first, again)
    alone = cpu_decode.decode_scores(q[2:4].contiguous(), tiles[2:4].contiguous(), lens[1:2].contiguous(), 48,
                                     0.125)
    assert torch.equal(alone, first[2:4])  # a head's result depends on nothing else in the batch


def test_tiled_layout_and_append_index():
    keys = torch.randn(4, 32, 16)
    tiles = cpu_decode.tile_keys(keys)
    assert tiles.shape == (4, 2, 16, 16)
    heads, position = torch.tensor([0, 1, 3, 3]), torch.tensor([0, 17, 15, 31])
    index = cpu_decode.tiled_index(heads, position, 32, 16)
    expected = torch.stack([keys[h, p] for h, p in zip(heads.tolist(), position.tolist())]).flatten()
    assert torch.equal(tiles.flatten()[index], expected)


@needs_kernel
@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(q=a["q"].double()), "q must be float32"),
    (lambda a: a.update(q=a["q"].transpose(1, 2)), "q must be a contiguous"),
    (lambda a: a.update(q=a["q"][0]), "q must be 3-D"),
    (lambda a: a.update(q=torch.randn(6, 9, 64)), "G<=8"),
    (lambda a: a.update(lens=a["lens"].int()), "lens must be int64"),
    (lambda a: a.update(lens=torch.tensor([0, 3, 5])), "lens must lie in"),
    (lambda a: a.update(width=64), "width <= cap"),
    (lambda a: a.update(tiles=[1, 2]), "tiles must be a torch.Tensor"),
    (lambda a: a.update(scale=float("nan")), "scale must be finite"),
    (lambda a: a.update(width=1.5), "width"),
])
def test_scores_argument_errors(change, match):
    q, keys, _, _ = make(3, 2, 3, 64, 48, seed=2)
    args = dict(q=q, tiles=cpu_decode.tile_keys(keys), lens=torch.tensor([5, 48, 7]), width=48, scale=0.125)
    change(args)
    with pytest.raises((ValueError, TypeError), match=match):
        cpu_decode.decode_scores(**args)


@needs_kernel
def test_pv_argument_errors():
    _, _, values, lens = make(2, 1, 2, 32, 32, seed=3)
    with pytest.raises(ValueError, match="values float32"):
        cpu_decode.decode_pv(torch.rand(2, 2, 32), values[:, :30].contiguous(), lens)
    with pytest.raises(ValueError, match="lens must lie in"):
        cpu_decode.decode_pv(torch.rand(2, 2, 8), values, torch.tensor([9, 3]))


def test_switch_and_failed_build_fall_back(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    assert not cpu_decode.available()
    assert not cpu_decode.supports(torch.float32, 64, 3, torch.device("cpu"))
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "1")
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_decode, "_tried", False)
    monkeypatch.setattr(cpu_decode, "_library", None)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert not cpu_decode.available()
    with pytest.raises(RuntimeError, match="not available"):
        cpu_decode.decode_pv(torch.rand(1, 1, 16), torch.rand(1, 16, 16), torch.tensor([4]))
    assert not list(tmp_path.iterdir())  # nothing half-built left in the cache


@needs_kernel
def test_build_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path))
    first = cpu_decode._build()
    assert first.parent == tmp_path / "kernels" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert cpu_decode._build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporaries left
