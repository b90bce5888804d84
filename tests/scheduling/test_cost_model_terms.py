"""The cost model's stateful and robust-fit mechanisms, the roofline's per-shape-class GEMM efficiency and
the published GPU figures (loose bounds: the measured numbers live in bench/sim_fidelity.py and
bench/roofline_check.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from servelab.scheduling.simulator import MODEL_PRESETS, RooflineCostModel, StepCostModel, hardware_table
from servelab.scheduling.simulator.calibrate import measure_steps
from servelab.scheduling.simulator.features import EXTRA_FEATURES, FEATURES, DecodeContinuity, extra_features
from servelab.scheduling.simulator.hardware import Hardware, published_figures


def _out(counts: dict[str, int], computed: int = 10):
    """A stand-in ``SchedulerOutput``: ``counts`` tokens per request after ``computed`` each."""
    return SimpleNamespace(num_scheduled_tokens=dict(counts), total_num_scheduled_tokens=sum(counts.values()),
                           total_num_kv_tokens=sum(computed + n for n in counts.values()),
                           iter_scheduled=lambda: [(r, computed, n) for r, n in counts.items()])


STEPS = [({"a": 5, "b": 1}, (1, 1, 1)),  # a prompt chunk: its decode b is gathered afresh
         ({"a": 1, "b": 1}, (0, 1, 2)),  # first pure decode after it: restart
         ({"b": 1, "a": 1}, (0, 0, 0)),  # same requests: carried
         ({"a": 1}, (0, 1, 1)),  # b left: the batch changed
         ({"a": 1}, (0, 0, 0)),
         ({"a": 1, "c": 3}, (1, 1, 1)),
         ({"c": 2}, (1, 0, 0)),  # a chunk alone: nothing to gather for decodes
         ({"a": 1, "c": 1}, (0, 1, 2))]


def test_decode_continuity_marks_every_restart_and_only_those():
    continuity = DecodeContinuity()
    assert [extra_features(_out(c), continuity) for c, _ in STEPS] == [want for _, want in STEPS]
    continuity.reset()
    assert continuity(_out({"a": 1, "c": 1})) == (1, 2)
    assert len(FEATURES + EXTRA_FEATURES) == 8


def test_restart_terms_are_charged_by_time_of_in_step_order():
    model = StepCostModel(1e-3, 0.0, 0.0, per_prefill_seq_s=2e-3, per_decode_restart_s=5e-3, per_restarted_seq_s=1e-3)
    timer = model.timer()
    times = [timer(_out(c)) for c, _ in STEPS]
    want = [1e-3 + 2e-3 * p + 5e-3 * r + 1e-3 * n for _, (p, r, n) in STEPS]
    np.testing.assert_allclose(times, want)
    # The model holds no state: a second timer starts afresh, and time_of alone restarts every decode step.
    again = model.timer()
    assert [again(_out(c)) for c, _ in STEPS] == times
    carried = _out({"a": 1, "b": 1})
    assert model.time_of(carried) == model.time_of(carried) == pytest.approx(1e-3 + 5e-3 + 2e-3)
    old = StepCostModel(1e-3, 1e-5, 1e-7)  # the three-term model stays stateless and unchanged
    assert [old.time_of(_out(c)) for c, _ in STEPS] == [old.time_of(_out(c)) for c, _ in STEPS]
    assert old.time_of(_out({"a": 1})) == pytest.approx(1e-3 + 1e-5 + 1e-7 * 11)
    assert "_continuity" not in old.as_dict() and old == StepCostModel(1e-3, 1e-5, 1e-7)


def _rows(model: StepCostModel, n: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        seqs = int(rng.integers(1, 32))
        prefill_seqs = int(rng.integers(0, 3)) if rng.random() < 0.4 else 0
        prefill = prefill_seqs * int(rng.integers(8, 200))
        tokens = seqs - prefill_seqs + prefill
        kv = tokens + int(rng.integers(0, 4000))
        pairs = float(prefill * rng.integers(4, 200))
        restart = int(prefill_seqs == 0 and rng.random() < 0.3)
        feats = (tokens, kv, seqs, prefill, pairs, prefill_seqs, restart, restart * seqs)
        rows.append((*feats, model.step_time(*feats)))
    return rows


def test_fit_recovers_all_nine_terms_and_drops_interrupted_steps():
    true = StepCostModel(5e-3, 2e-5, 3e-7, 1e-4, 1e-4, 1e-8, 8e-4, 1.2e-3, 9e-5)
    rows = _rows(true, 300, seed=1)
    for weighted in (False, True):
        fitted = StepCostModel.fit(rows, relative=weighted)
        np.testing.assert_allclose([fitted.step_time(*r[:-1]) for r in rows], [r[-1] for r in rows], rtol=1e-6)
    # A shared machine interrupts 5% of the steps by 30 ms: the trimmed refit ignores them.
    noisy = [(*r[:-1], r[-1] + (0.03 if i % 20 == 0 else 0.0)) for i, r in enumerate(rows)]
    plain = StepCostModel.fit(noisy, relative=True)
    trimmed = StepCostModel.fit(noisy, relative=True, outlier_mads=5.0)
    clean = [r for i, r in enumerate(rows) if i % 20]

    def worst(m):
        return max(abs(m.step_time(*r[:-1]) - r[-1]) / r[-1] for r in clean)

    assert worst(trimmed) < 1e-3 < worst(plain)
    with pytest.raises(ValueError, match="outlier_mads"):
        StepCostModel.fit(rows, outlier_mads=0)
    with pytest.raises(ValueError, match="rows"):
        StepCostModel.fit([r[:8] for r in rows])


def test_gemm_efficiency_curve_interpolates_per_shape_class():
    base = hardware_table()["H100-SXM"]
    curve = Hardware(**{**base.__dict__, "name": "c", "gemm_efficiency_curve": [[1, 0.1], [4, 0.3], [64, 0.9]]})
    assert curve.gemm_efficiency_at(1) == 0.1 and curve.gemm_efficiency_at(1000) == 0.9
    assert curve.gemm_efficiency_at(2) == pytest.approx(0.2)  # halfway in log(rows)
    assert base.gemm_efficiency_at(7) == base.gemm_efficiency  # no curve: the constant
    for bad in ([[4, 0.3], [1, 0.1]], [[1, 0.0]], [[1]], "fast"):
        with pytest.raises(ValueError, match="gemm_efficiency_curve"):
            Hardware(**{**base.__dict__, "gemm_efficiency_curve": bad})
    cpu = RooflineCostModel(hardware_table()["cpu-measured"], MODEL_PRESETS["smollm2-135m"])
    # The measured CPU's curve decides a decode's GEMM time, not the weight streaming: one row runs
    # far below the streaming rate (a decode of 1 costs more than of 4 there, as measured), and 16
    # rows cost less than 16 single rows.
    one, four, sixteen = (cpu.breakdown(n, 100 * n, n)["gemm"] for n in (1, 4, 16))
    assert one > 1.2 * four and sixteen < 4 * one


def test_published_gpu_figures_are_sourced_and_within_a_loose_bound():
    figures = published_figures()
    table = hardware_table()
    assert len(figures) >= 1
    for fig in figures:
        assert fig["hardware"] in table and fig["source"] and fig["metric"] in ("tpot_p50_s", "decode_tok_s")
        model = StepCostModel.for_hardware(fig["hardware"], fig["model"], dtype=fig["dtype"])
        tok_s = model.decode_throughput(fig["batch"], fig["context"])
        pred = fig["batch"] / tok_s if fig["metric"] == "tpot_p50_s" else tok_s
        assert abs(pred - fig["value"]) / fig["value"] < 0.3, fig["source"]


def test_measure_steps_refuses_a_wrong_number_of_output_lengths():
    pipe = SimpleNamespace(has_unfinished_requests=lambda: False, scheduler=SimpleNamespace(schedule=None))
    with pytest.raises(ValueError, match="max_tokens"):
        measure_steps(pipe, [[1, 2], [3, 4]], [4])
    with pytest.raises(ValueError, match="max_tokens"):
        measure_steps(pipe, [[1, 2]], [0])
