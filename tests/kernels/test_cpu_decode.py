"""The C decode-attention kernel (``servelab.attention.cpu_decode``) against float64, and its build.

Random shapes (rows, KV heads per row, GQA group 1-8, head sizes that take
the wide and the narrow value loop, lengths from 1 to ``cap``, result widths
past the longest length) at one and at several threads; the scores and the
value product each within float32 rounding of the float64 products, the
fused path (scores, the kernel's softmax, values) within float32 rounding of
float64 attention, all with the same bits for every thread count; the tiled K layout against plain indexing;
argument checks. The build: a machine with a C compiler must build the kernel
(a failed build FAILS here, it is not skipped); the cache is keyed by the
compiler's resolved target, so a library built for other target flags is
never loaded (neither by name nor when planted under this machine's name);
a library that dies in verification (SIGILL) is survived, rebuilt, and on a
second failure the torch formulation runs with one warning. Every build goes
to a temporary folder (``tests/conftest.py`` sets ``SERVELAB_KERNEL_CACHE``).
"""

from __future__ import annotations

import shutil
import subprocess
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention import cpu_decode, cpu_kernel_build
from servelab.attention.cpu_kernel_build import KernelBuildError

HAS_COMPILER = shutil.which(cpu_kernel_build.compiler()) is not None


@pytest.fixture(scope="module")
def kernel():
    """The built kernel: skips only without a compiler; a compiler that fails to build it fails the test."""
    if not HAS_COMPILER:
        pytest.skip(f"no C compiler ({cpu_kernel_build.compiler()!r}): the torch formulation is tested instead")
    try:
        built = cpu_kernel_build.load()
    except KernelBuildError as error:
        pytest.fail(f"a C compiler exists but the kernel did not build: {error}")
    assert cpu_decode.available()
    return built


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache and no build in this process yet (restored afterwards)."""
    monkeypatch.setenv("SERVELAB_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(cpu_kernel_build, "_built", None)
    monkeypatch.setattr(cpu_kernel_build, "_error", None)
    monkeypatch.setattr(cpu_decode, "_warned", False)
    return tmp_path / "kernels"


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


@pytest.mark.parametrize("threads", [1, 2, 3])
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), kv_per_row=st.integers(1, 3), group=st.integers(1, 8),
       head_size=st.sampled_from([16, 32, 64, 128]), tiles=st.integers(1, 6), extra=st.integers(0, 20),
       seed=st.integers(0, 2**16))
def test_kernel_matches_float64(kernel, threads, rows, kv_per_row, group, head_size, tiles, extra, seed):
    """At 1, 2 and 3 threads (more threads than heads included): float64-close, and the same
    bits as one thread (every head is computed whole by one thread, in one order)."""
    with torch_threads(threads):
        check_against_float64(rows, kv_per_row, group, head_size, tiles, extra, seed)


def check_against_float64(rows, kv_per_row, group, head_size, tiles, extra, seed):
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
    # The fused path (scores, the kernel's own softmax, values in one call) against float64.
    q_rows = q.view(rows, -1, head_size)
    fused = cpu_decode.attend(q_rows, cpu_decode.tile_keys(keys), values, lens, kv_per, width, scale)
    p64 = torch.softmax(expected, dim=-1)
    for h in range(q.shape[0]):
        n = int(lens[h // kv_per])
        torch.testing.assert_close(fused[h].double(), p64[h, :, :n] @ values[h, :n].double(), rtol=1e-5, atol=1e-5)
    # With ``append``: the newest position of each row (NaN in the buffers) is copied in from a
    # paged cache by the kernel itself, then attended: the same bits as the full buffers.
    check_append(q_rows, keys, values, lens, kv_per, width, scale, seed)
    if torch.get_num_threads() > 1:
        with torch_threads(1):
            assert torch.equal(cpu_decode.decode_scores(q, cpu_decode.tile_keys(keys), lens, width, scale), scores)
            assert torch.equal(cpu_decode.decode_pv(p_poisoned, values, lens), out)
            assert torch.equal(cpu_decode.attend(q_rows, cpu_decode.tile_keys(keys), values, lens, kv_per, width,
                                                 scale), fused)


def check_append(q_rows, keys, values, lens, kv_per, width, scale, seed):
    """``attend(..., append=(key_rows, value_rows, slots))`` on buffers whose newest positions
    are NaN: the buffers end up equal to the full ones, the output bit-equal to attending those."""
    rows, head_size = lens.numel(), keys.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(rows + 3, generator=gen)[:rows]  # each row's newest position, anywhere in the cache
    key_rows = torch.randn(rows + 3, kv_per, head_size, generator=gen)
    value_rows = torch.randn(rows + 3, kv_per, head_size, generator=gen)
    newest = (lens - 1).repeat_interleave(kv_per)
    heads = torch.arange(rows * kv_per)
    full_k, full_v = keys.clone(), values.clone()
    full_k[heads, newest] = key_rows[slots].reshape(-1, head_size)
    full_v[heads, newest] = value_rows[slots].reshape(-1, head_size)
    stale_k, stale_v = full_k.clone(), full_v.clone()
    stale_k[heads, newest] = float("nan")
    stale_v[heads, newest] = float("nan")
    tiles = cpu_decode.tile_keys(stale_k)
    out = cpu_decode.attend(q_rows, tiles, stale_v, lens, kv_per, width, scale, append=(key_rows, value_rows, slots))
    assert torch.equal(tiles, cpu_decode.tile_keys(full_k)) and torch.equal(stale_v, full_v)
    again = cpu_decode.attend(q_rows, cpu_decode.tile_keys(full_k), full_v, lens, kv_per, width, scale)
    assert torch.equal(out, again)


class torch_threads:
    """``with torch_threads(n):`` runs the block on ``n`` torch threads."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def test_threads_split_long_batches_and_agree(kernel):
    """A step big enough to use the team (16 rows x 3 KV heads, long contexts): same bits on 1 and
    2 threads, and the kernel was built with OpenMP when the compiler has it."""
    q, keys, values, lens = make(16, 3, 3, 64, 256, seed=9)
    tiles = cpu_decode.tile_keys(keys)
    results = []
    for threads in (1, 2):
        with torch_threads(threads):
            scores = cpu_decode.decode_scores(q, tiles, lens, 256, 0.125)
            results.append((scores, cpu_decode.decode_pv(torch.softmax(scores, -1), values, lens)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    if "-fopenmp" in kernel.flags:
        assert kernel.openmp and cpu_decode.uses_openmp()


def test_kernel_is_deterministic_and_row_independent(kernel):
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
def test_scores_argument_errors(kernel, change, match):
    q, keys, _, _ = make(3, 2, 3, 64, 48, seed=2)
    args = dict(q=q, tiles=cpu_decode.tile_keys(keys), lens=torch.tensor([5, 48, 7]), width=48, scale=0.125)
    change(args)
    with pytest.raises((ValueError, TypeError), match=match):
        cpu_decode.decode_scores(**args)


def test_pv_argument_errors(kernel):
    _, _, values, lens = make(2, 1, 2, 32, 32, seed=3)
    with pytest.raises(ValueError, match="values float32"):
        cpu_decode.decode_pv(torch.rand(2, 2, 32), values[:, :30].contiguous(), lens)
    with pytest.raises(ValueError, match="lens must lie in"):
        cpu_decode.decode_pv(torch.rand(2, 2, 8), values, torch.tensor([9, 3]))


def test_switch_and_no_compiler_fall_back(fresh_build, monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    assert not cpu_decode.available()
    assert not cpu_decode.supports(torch.float32, 64, 3, torch.device("cpu"))
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "1")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert not cpu_decode.available()
    with pytest.raises(RuntimeError, match="not available"):
        cpu_decode.decode_pv(torch.rand(1, 1, 16), torch.rand(1, 16, 16), torch.tensor([4]))
    assert not fresh_build.exists() or not list(fresh_build.iterdir())  # nothing half-built left


def test_build_is_cached_and_keyed_by_resolved_target(kernel, fresh_build):
    first = cpu_kernel_build.build()
    assert first.path.parent == fresh_build and first.path.is_file()
    assert first.path.name == f"cpu_kernels-{first.key}.so"
    stamp = first.path.stat().st_mtime_ns
    assert cpu_kernel_build.build().path == first.path and first.path.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in fresh_build.iterdir()] == [first.path.name]  # no temporaries left
    target = cpu_kernel_build.resolved_target(cpu_kernel_build.compiler(), first.flags)
    if "-march=native" in first.flags:  # the key holds what -march=native resolves to, not a CPU model name
        assert "-march=" in target or "-target-cpu" in target, target


def test_library_built_for_other_flags_is_never_loaded(kernel, fresh_build, monkeypatch):
    """Machine A (target flags ``-mfake-a``) and machine B (``-mfake-b``) share a cache: B never
    loads A's file, neither under A's name nor when A's file sits under B's name."""
    real = cpu_kernel_build.resolved_target
    machine = {"target": "-mfake-a"}
    monkeypatch.setattr(cpu_kernel_build, "resolved_target", lambda cc, flags: real(cc, flags) + machine["target"])
    built_a = cpu_kernel_build.build()
    machine["target"] = "-mfake-b"
    path_b = cpu_kernel_build.library_path(cpu_kernel_build.cache_key(
        cpu_kernel_build.source_bytes(),
        subprocess.run([cpu_kernel_build.compiler(), "--version"], capture_output=True, text=True).stdout,
        built_a.flags, cpu_kernel_build.resolved_target(cpu_kernel_build.compiler(), built_a.flags)))
    assert path_b != built_a.path  # other target flags: another cache entry
    shutil.copy(built_a.path, path_b)  # A's binary under B's name (a mislabelled or colliding file)
    assert "build key" in cpu_kernel_build.verify(path_b, path_b.stem.split("-")[-1])
    built_b = cpu_kernel_build.build()
    assert built_b.path == path_b and built_b.key != built_a.key
    built_b.library.servelab_build_key.restype = __import__("ctypes").c_char_p
    assert built_b.library.servelab_build_key().decode() == built_b.key  # rebuilt for B, then loaded


TRAP_SOURCE = r"""
#include <stdint.h>
int servelab_abi_version(void) { __builtin_trap(); return 0; }
"""


def test_a_crashing_library_is_survived_then_rebuilt(kernel, fresh_build, monkeypatch, tmp_path):
    """A cached library that dies in verification (SIGILL/SIGTRAP from ``__builtin_trap``, as an
    instruction the CPU lacks would) kills only the child; the parent rebuilds it and loads that."""
    trap = tmp_path / "trap.so"
    subprocess.run([cpu_kernel_build.compiler(), "-shared", "-fPIC", "-o", str(trap), "-x", "c", "-"],
                   input=TRAP_SOURCE, text=True, check=True)
    path = cpu_kernel_build.library_path(kernel.key)  # where this machine's build goes (fresh cache)
    path.parent.mkdir(parents=True)
    shutil.copy(trap, path)
    assert "signal" in cpu_kernel_build.verify(path, kernel.key)
    rebuilt = cpu_kernel_build.build()
    assert rebuilt.path == path and rebuilt.key == kernel.key  # rebuilt in place, verified, loaded


def test_crashing_builds_fall_back_with_one_warning(kernel, fresh_build, monkeypatch, tmp_path):
    trap = tmp_path / "trap.so"
    subprocess.run([cpu_kernel_build.compiler(), "-shared", "-fPIC", "-o", str(trap), "-x", "c", "-"],
                   input=TRAP_SOURCE, text=True, check=True)

    def compile_trap(cc, flags, key, target):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(trap, target)

    monkeypatch.setattr(cpu_kernel_build, "compile_library", compile_trap)
    with pytest.warns(RuntimeWarning, match="signal") as caught:
        assert not cpu_decode.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu_decode.available()  # the outcome is remembered: no second build, no second warning
    assert len([w for w in caught if "unavailable" in str(w.message)]) == 1


def test_failed_compile_is_an_error_not_a_skip(fresh_build, monkeypatch, tmp_path):
    """A compiler that rejects the source: every flag set fails, the reasons are reported."""
    if not HAS_COMPILER:
        pytest.skip("no C compiler")
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(cpu_kernel_build, "SOURCES", (bad,))
    with pytest.raises(KernelBuildError, match="-march=native"):
        cpu_kernel_build.build()


def test_pipeline_construction_builds_the_kernel(kernel, fresh_build, tmp_path):
    """The ``"sdpa"`` backend builds (and verifies) the kernel when a pipeline is constructed, so the
    first decode step is not a compile."""
    from servelab import Pipeline
    from servelab.models import build_tiny_model, load_model

    model, _ = load_model(build_tiny_model(tmp_path / "tiny", arch="llama", seed=0, hidden_size=64,
                                           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1))
    assert cpu_kernel_build._built is None
    Pipeline(model, attention_backend="sdpa", max_num_seqs=2, max_model_len=64, num_blocks=8, block_size=16)
    assert cpu_kernel_build._built is not None and cpu_kernel_build._built.path.parent == fresh_build


def test_build_kernels_command(kernel, fresh_build, monkeypatch, capsys, tmp_path):
    from servelab.cli import main

    assert main(["build-kernels"]) == 0
    assert str(fresh_build) in capsys.readouterr().out
    monkeypatch.setattr(cpu_kernel_build, "_built", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert main(["build-kernels"]) == 1
    assert "no C compiler" in capsys.readouterr().err
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    assert main(["build-kernels"]) == 2
