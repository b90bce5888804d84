"""The few-row C GEMM (``servelab.models.cpu_gemm``) against a float64 reference, and its routing.

Both panel widths run on any machine: the loaded library's (64 columns on an AVX-512 build, 16
elsewhere), and ``panel_gemm.c`` compiled alone with a second flag set (``second_build``: AVX2 +
FMA, and the compiler's plain target), run through ``cpu_gemm`` with the library swapped."""

import contextlib
import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from servelab.attention import cpu_decode, cpu_kernel_build
from servelab.models import build_tiny_model, cpu_gemm
from servelab.models.linear import Linear

from model_harness import error_bound

SOURCE = Path(cpu_kernel_build.__file__).with_name("csrc") / "panel_gemm.c"
#: name -> (flags, CPU features they need): builds of panel_gemm.c beside the loaded library.
SECOND_BUILDS = {
    "avx2_fma": (("-O3", "-march=haswell"), {"avx2", "fma"}),  # the 16-column route of CPUs without AVX-512
    "plain": (("-O3",), set()),  # the compiler's default target (x86-64: SSE2, no FMA)
}


@pytest.fixture(scope="module")
def kernel(kernel_library):
    """The library loaded (conftest's ``kernel_library``)."""


def reported_width(lib) -> int:
    """``servelab_panel_gemm_width()`` of a loaded library."""
    width = lib["servelab_panel_gemm_width"]
    width.restype = ctypes.c_int64
    return width()


@contextlib.contextmanager
def library_swapped(lib):
    """``cpu_gemm`` running on ``lib`` within the block (as if its LibraryOnce had found it)."""
    swapped, before = cpu_decode.LibraryOnce(), cpu_gemm._library
    swapped.lib, swapped.checked = lib, True
    cpu_gemm._library = swapped
    try:
        yield
    finally:
        cpu_gemm._library = before


def cpu_features() -> set[str]:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith(("flags", "Features"))),
                set())


@pytest.fixture(scope="module", params=sorted(SECOND_BUILDS))
def second_build(request, tmp_path_factory):
    """``(name, library)``: panel_gemm.c alone, compiled with ``SECOND_BUILDS[name]`` (and OpenMP
    where the compiler has it) into a temporary folder, bound as servelab's loader binds it.
    Skips when this CPU lacks the flags' features or the compiler refuses them."""
    flags, needs = SECOND_BUILDS[request.param]
    cc = cpu_kernel_build.compiler()
    if shutil.which(cc) is None:
        pytest.skip("no C compiler")
    if needs - cpu_features():
        pytest.skip(f"this CPU lacks {', '.join(sorted(needs - cpu_features()))} for {' '.join(flags)}")
    target = tmp_path_factory.mktemp(f"panel_gemm_{request.param}") / "panel_gemm.so"
    for openmp in (("-fopenmp",), ()):
        done = subprocess.run([cc, *flags, *openmp, "-shared", "-fPIC", "-o", str(target), str(SOURCE)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            break
    else:
        pytest.skip(f"{cc} refuses {' '.join(flags)}: {done.stderr.strip()[-200:]}")
    lib = ctypes.CDLL(str(target))
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.servelab_panel_gemm.argtypes, lib.servelab_panel_gemm.restype = [p, i, p, p, p, i, i, i, i], None
    lib.servelab_panel_gemm_preferred.argtypes, lib.servelab_panel_gemm_preferred.restype = [], ctypes.c_int
    return request.param, lib


def assert_panel_layout(panels, weight, width):
    """``panels`` is ``weight`` ``[N, K]`` in panels ``[ceil(N / width), K, width]``, zero past ``N``."""
    n, k = weight.shape
    assert panels.shape == (-(-n // width), k, width) and panels.is_contiguous()
    for p in range(panels.shape[0]):
        columns = weight[p * width:(p + 1) * width]
        assert torch.equal(panels[p, :, :columns.shape[0]], columns.T)
        assert not panels[p, :, columns.shape[0]:].any()


def with_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(0, 40), k=st.integers(0, 300), n=st.integers(1, 300), has_bias=st.booleans(),
       row_gap=st.integers(0, 9), threads=st.sampled_from([1, 2, 3]), scale=st.sampled_from([1e-3, 1.0, 30.0]),
       seed=st.integers(0, 2**16))
def test_gemm_is_within_the_float32_bound_of_float64(kernel, rows, k, n, has_bias, row_gap, threads, scale, seed):
    """Row blocks of 4 and their tails, partial panels, K not a multiple of the vector width,
    strided rows (a slice of a wider tensor), 1-3 threads."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * scale
    bias = torch.randn(n, generator=gen) if has_bias else None
    x = (torch.randn(rows, k + row_gap, generator=gen) * scale)[:, :k]
    got = with_threads(threads, lambda: cpu_gemm.gemm(x, cpu_gemm.pack(weight), bias, n))
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == (rows, n) and got.dtype == torch.float32 and got.is_contiguous()
    assert ((got.double() - reference).abs() <= error_bound(x, weight, bias)).all()


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 24), k=st.integers(1, 200), n=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_thread_count(kernel, rows, k, n, seed):
    gen = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    panels = cpu_gemm.pack(weight)
    batch = cpu_gemm.gemm(x, panels, None, n)
    for threads in (1, 2, 3):
        assert torch.equal(with_threads(threads, lambda: cpu_gemm.gemm(x, panels, None, n)), batch)
    for row in (0, rows - 1):
        assert torch.equal(cpu_gemm.gemm(x[row:row + 1], panels, None, n), batch[row:row + 1])


def test_pack_lays_out_panels_of_the_librarys_width_zero_padded(kernel):
    width = reported_width(cpu_gemm._library.lib)
    assert cpu_gemm.panel_width() == width and width in (16, 64)
    weight = torch.arange((2 * width + 6) * 3, dtype=torch.float32).view(2 * width + 6, 3)
    assert_panel_layout(cpu_gemm.pack(weight), weight, width)


def test_pack_without_a_library_uses_the_fallback_width(monkeypatch):
    unavailable = cpu_decode.LibraryOnce()
    unavailable.checked = True  # looked up, and None
    monkeypatch.setattr(cpu_gemm, "_library", unavailable)
    weight = torch.randn(70, 3)
    assert cpu_gemm.panel_width() == cpu_gemm.FALLBACK_PANEL
    assert_panel_layout(cpu_gemm.pack(weight), weight, cpu_gemm.FALLBACK_PANEL)


class CountingLibrary:
    """Answers what cpu_gemm asks a library (its width, its preference), counting the questions."""

    def __init__(self, width, preferred):
        self.width, self.preferred, self.asked = width, preferred, 0

    def servelab_panel_gemm_preferred(self):
        self.asked += 1
        return self.preferred

    def __getitem__(self, name):
        assert name == "servelab_panel_gemm_width"
        library = self

        class Function:  # a ctypes function's surface: argtypes / restype set, then called
            def __call__(self):
                library.asked += 1
                return library.width

        return Function()


def test_width_and_preference_are_asked_once_per_library_and_a_swapped_library_does_not_stick(kernel):
    real = (cpu_gemm.panel_width(), cpu_gemm.preferred())
    other = CountingLibrary(width=8 if real[0] != 8 else 32, preferred=int(not real[1]))
    with library_swapped(other):
        assert (cpu_gemm.panel_width(), cpu_gemm.preferred()) == (other.width, not real[1])
        weight = torch.randn(other.width + 1, 2)
        assert_panel_layout(cpu_gemm.pack(weight), weight, other.width)
        assert other.asked == 2  # once each, for this library
    assert (cpu_gemm.panel_width(), cpu_gemm.preferred()) == real  # the loaded library's answers again


def test_a_second_build_reports_its_width_and_route(second_build):
    """The AVX2 + FMA build lays 16-column panels and is preferred (it measured faster than oneDNN /
    F.linear capped to AVX2, csrc/panel_gemm.c's header); a 64-column build is an AVX-512 one."""
    name, lib = second_build
    width, preferred = reported_width(lib), lib.servelab_panel_gemm_preferred()
    if name == "avx2_fma":
        assert (width, preferred) == (16, 1)
    assert width in (16, 64) and preferred in (0, 1)
    with library_swapped(lib):
        assert (cpu_gemm.panel_width(), cpu_gemm.preferred()) == (width, bool(preferred))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 40), k=st.integers(0, 300), n=st.integers(1, 300), has_bias=st.booleans(),
       row_gap=st.integers(0, 9), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
@example(rows=13, k=300, n=300, has_bias=True, row_gap=3, threads=3, seed=1)  # parallel: k * n >= 65536
def test_a_second_build_is_within_the_float32_bound_and_batch_invariant(second_build, rows, k, n, has_bias,
                                                                        row_gap, threads, seed):
    """The other panel width (16 on an AVX-512 machine) against float64, and each row's bits alone
    and at one thread equal to the batch's."""
    _, lib = second_build
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if has_bias else None
    x = torch.randn(rows, k + row_gap, generator=gen)[:, :k]
    with library_swapped(lib):
        panels = cpu_gemm.pack(weight)
        assert panels.shape[2] == reported_width(lib)
        got = with_threads(threads, lambda: cpu_gemm.gemm(x, panels, bias, n))
        reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        assert got.shape == (rows, n) and ((got.double() - reference).abs() <= error_bound(x, weight, bias)).all()
        for row in {0, rows - 1} if rows else ():
            alone = with_threads(1, lambda: cpu_gemm.gemm(x[row:row + 1], panels, bias, n))
            assert torch.equal(alone, got[row:row + 1])


def test_bad_arguments_name_themselves(kernel):
    weight, x = torch.randn(10, 8), torch.randn(3, 8)
    panels = cpu_gemm.pack(weight)
    with pytest.raises(TypeError, match="weight must be a tensor"):
        cpu_gemm.pack([[1.0]])
    with pytest.raises(ValueError, match="weight .* must be a 2-D float32 CPU tensor"):
        cpu_gemm.pack(weight.double())
    with pytest.raises(TypeError, match="x must be a tensor"):
        cpu_gemm.gemm(x.tolist(), panels, None, 10)
    with pytest.raises(TypeError, match="bias must be a tensor or None"):
        cpu_gemm.gemm(x, panels, 1.0, 10)
    with pytest.raises(ValueError, match="out_features must be a positive int"):
        cpu_gemm.gemm(x, panels, None, 0)
    with pytest.raises(ValueError, match=r"x \(shape \(3, 8\), strides \(1, 3\)"):
        cpu_gemm.gemm(x.T.contiguous().T, panels, None, 10)  # K not contiguous
    with pytest.raises(ValueError, match="panels .* must be pack"):
        cpu_gemm.gemm(x, panels, None, 65)  # panels of a [10, 8] weight read as [65, 8]
    with pytest.raises(ValueError, match="panels .* must be pack"):
        cpu_gemm.gemm(torch.randn(3, 9), panels, None, 10)
    with pytest.raises(ValueError, match=r"bias \(shape \(9,\)"):
        cpu_gemm.gemm(x, panels, torch.randn(9), 10)


def test_linear_takes_the_kernel_for_few_rows_only_and_repacks_a_changed_weight(kernel, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)  # the routing, on any build
    layer = Linear(40, 70).requires_grad_(False)
    few, many = torch.randn(cpu_gemm.MAX_ROWS, 40), torch.randn(cpu_gemm.MAX_ROWS + 1, 40)
    cache = layer._packed_weight()
    assert torch.equal(layer(few), cpu_gemm.gemm(few, cpu_gemm.pack(layer.weight), layer.bias, 70))
    assert cache.panels_key is not None
    assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))  # a small weight, many rows
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: the version counter moves, the panels are remade
    torch.testing.assert_close(layer(few), F.linear(few, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 40, requires_grad=True)
    with torch.enable_grad():
        layer.requires_grad_(True)(x).sum().backward()  # autograd sees F.linear
    assert x.grad is not None


def test_a_pipeline_generates_the_same_tokens_with_and_without_the_kernel(kernel, tmp_path, monkeypatch):
    from servelab import Pipeline, SamplingParams

    path = build_tiny_model(tmp_path / "tiny", seed=3)
    prompts = [[1, 5, 9, 2], [7] * 20, list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for use in (True, False):  # the kernel on any build, or never
        monkeypatch.setattr(cpu_gemm, "preferred", lambda use=use: use)
        pipe = Pipeline.from_pretrained(path)
        outputs[use] = [o.token_ids for o in pipe.generate(prompts, params)]
        used = pipe.model.model.layers[0].mlp.down_proj._packed_weight().panels_key is not None
        assert used is use
    assert outputs[True] == outputs[False]


def test_without_the_library_linear_keeps_f_linear_and_gemm_refuses(monkeypatch):
    """SERVELAB_CPU_KERNELS=0, no compiler, or a failed build: the same layer runs F.linear
    (a small weight) bit for bit, and the public gemm names the reason it refuses."""
    unavailable = cpu_decode.LibraryOnce()
    unavailable.checked = True  # looked up, and None
    monkeypatch.setattr(cpu_gemm, "_library", unavailable)
    layer = Linear(40, 70).requires_grad_(False)
    x = torch.randn(3, 40)
    assert not cpu_gemm.usable(x)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer._packed_weight().panels_key is None
    with pytest.raises(ValueError, match="kernel library built"):
        cpu_gemm.gemm(x, cpu_gemm.pack(layer.weight), None, 70)


def test_a_bias_that_autograd_records_keeps_f_linear(kernel):
    layer = Linear(8, 4)
    layer.weight.requires_grad_(False)
    layer(torch.randn(2, 8)).sum().backward()  # only the bias needs a gradient
    assert layer.bias.grad is not None and layer._packed_weight().panels_key is None


def test_the_route_is_preferred_on_avx512_and_avx2_fma_builds(kernel, monkeypatch):
    lib = cpu_gemm._library.lib
    assert cpu_gemm.preferred() is bool(lib.servelab_panel_gemm_preferred())
    # what the compiler generated code for (gcc: -mavx512f / -mno-avx512f, clang: +avx512f / -avx512f)
    target = set(cpu_kernel_build.resolved_target(cpu_kernel_build.compiler(), cpu_kernel_build.load().flags).split())
    avx512 = bool({"-mavx512f", "+avx512f"} & target)
    avx2_fma = {"-mavx2", "-mfma"} <= target or {"+avx2", "+fma"} <= target
    if avx512 or avx2_fma:  # where the panels measured faster than oneDNN / F.linear
        assert (cpu_gemm.preferred(), reported_width(lib)) == (True, 64 if avx512 else 16)
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: False)  # e.g. a build without AVX2: oneDNN / F.linear
    layer = Linear(40, 70).requires_grad_(False)
    x = torch.randn(3, 40)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer._packed_weight().panels_key is None
