"""The ``"torch"`` LoRA kernel: the same four functions as :mod:`servelab.kernels.lora`
(Triton) and :mod:`servelab.reference.lora` (the spec; layout and semantics are documented
there), as a few dense GEMMs per adapter, any dtype. The CPU default is the C kernel
(``"cpu"``, :mod:`servelab.lora.cpu_kernels`), which falls back to these functions where
it does not apply (not float32, not on the CPU, no compiler).

Why grouped GEMMs: a step's rows use at most ``max_loras`` distinct slots, so
gathering each slot's rows and running ``x_g @ A.T`` then ``y_g @ B.T`` costs
one small GEMM pair per slot — the same arithmetic as the per-row
BGMV, without materialising a ``[T, R, in]`` gather of A per row. SGMV's
segments are already grouped: each segment is one GEMM pair, no gather.

Arithmetic is float32 (bf16/fp16 inputs upcast, as the Triton kernels accumulate),
float64 for float64 inputs (the tests' precision).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

__all__ = ["bgmv_expand", "bgmv_shrink", "sgmv_expand", "sgmv_shrink", "slot_groups"]


_LAST_GROUPS: list = [None, None, None]  # the last indices tensor (held: its id is never reused), a copy, groups


Group = tuple[int, "torch.Tensor | slice", list[slice]]


def slot_groups(indices: torch.Tensor) -> list[Group]:
    """``[(slot, rows, runs)]`` for each slot present in ``indices`` ``[T]`` (``-1`` skipped);
    ``rows`` is a slice when the slot's rows are contiguous (no gather needed), else their
    indices; ``runs``: the rows as contiguous slices (an in-place expand writes each). The last
    answer is kept for the same tensor object with the same values (a copy is compared:
    inference tensors have no version counter): a step's wrapped layers all pass the step's
    one indices tensor."""
    if _LAST_GROUPS[0] is indices and torch.equal(_LAST_GROUPS[1], indices):
        return _LAST_GROUPS[2]
    groups = _slot_groups(indices)
    _LAST_GROUPS[:] = [indices, indices.clone(), groups]
    return groups


def _slot_groups(indices: torch.Tensor) -> list[Group]:
    if indices.numel() == 0:
        return []
    values = indices.tolist()
    groups: dict[int, list[int]] = {}
    runs: dict[int, list[slice]] = {}
    previous = -1
    for t, slot in enumerate(values):
        if slot >= 0:
            groups.setdefault(slot, []).append(t)
            slot_runs = runs.setdefault(slot, [])
            if slot == previous:
                slot_runs[-1] = slice(slot_runs[-1].start, t + 1)
            else:
                slot_runs.append(slice(t, t + 1))
        previous = slot
    out: list[Group] = []
    for slot, rows in groups.items():
        if len(runs[slot]) == 1:
            out.append((slot, runs[slot][0], runs[slot]))
        else:
            out.append((slot, torch.tensor(rows, dtype=torch.int64, device=indices.device), runs[slot]))
    return out


def _shrink_groups(x: torch.Tensor, lora_a: torch.Tensor, groups: list[Group], scale: float) -> torch.Tensor:
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=acc, device=x.device)
    for slot, rows, _ in groups:
        part = x[rows].to(acc) @ lora_a[slot].to(acc).T
        out[rows] = part * scale if scale != 1.0 else part
    return out


def _expand_groups(y: torch.Tensor, lora_b: torch.Tensor, groups: list[Group], output: torch.Tensor,
                   slice_offset: int, add_inputs: bool) -> torch.Tensor:
    size = lora_b.shape[1]
    target = output[:, slice_offset:slice_offset + size]
    acc = torch.promote_types(y.dtype, torch.float32)
    in_place = add_inputs and output.dtype == acc  # one pass over the output rows: addmm into each run
    for slot, rows, runs in groups:
        if in_place and len(runs) <= 64:
            weight = lora_b[slot].to(acc).T
            for run in runs:
                target[run].addmm_(y[run].to(acc), weight)
            continue
        delta = y[rows].to(acc) @ lora_b[slot].to(acc).T
        if add_inputs:
            delta = delta + target[rows].to(acc)
        target[rows] = delta.to(output.dtype)
    return output


#: Few rows over many slots (a decode step spread over adapters) go to one GEMM against every
#: slot at once, then a gather (see :func:`_shrink_dense`), when ``rows * slots * width`` is at most
#: this: the wasted products are cheaper than a GEMM pair per slot (each ~10 us of fixed cost).
DENSE_MAX_ELEMENTS = 1 << 16
#: ... and the rows use at least this many distinct slots (fewer: the grouped loop is as cheap).
DENSE_MIN_GROUPS = 3


def _dense(num_rows: int, slots: int, rank: int, num_groups: int) -> bool:
    """``rows x slots x rank`` (the one GEMM's inner width times its rows) small enough, and enough slots."""
    return num_groups >= DENSE_MIN_GROUPS and num_rows * slots * rank <= DENSE_MAX_ELEMENTS


def _shrink_dense(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """``x @ [every slot's A].T`` ``[T, S * R]``, then each row's own slot's ``R`` columns (zeros for -1)."""
    slots, width, fan_in = lora_a.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    every = x.to(acc) @ lora_a.reshape(slots * width, fan_in).to(acc).T
    rows = x.shape[0]
    own = every.view(rows, slots, width).gather(1, indices.clamp(min=0).view(rows, 1, 1).expand(rows, 1, width))
    out = own.view(rows, width) * (indices >= 0).to(acc)[:, None]
    return out * scale if scale != 1.0 else out


def _expand_dense(y: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor, output: torch.Tensor,
                  slice_offset: int, add_inputs: bool) -> torch.Tensor:
    """Each row's ``y`` placed in its slot's block of a ``[T, S * R]`` row, times every slot's B at once."""
    slots, size, width = lora_b.shape
    acc = torch.promote_types(y.dtype, torch.float32)
    rows = y.shape[0]
    valid = indices >= 0
    wide = torch.zeros((rows, slots, width), dtype=acc, device=y.device)
    wide[valid, indices[valid]] = y[valid].to(acc)
    every_b = lora_b.permute(0, 2, 1).reshape(slots * width, size).to(acc)
    target = output[:, slice_offset:slice_offset + size]
    if add_inputs and output.dtype == acc:  # rows without a slot have zeros in ``wide``: adding is a no-op
        target.addmm_(wide.view(rows, slots * width), every_b)
        return output
    delta = wide.view(rows, slots * width) @ every_b
    if add_inputs:
        delta += target.to(acc)
    if bool(valid.all()):
        target.copy_(delta)
    else:
        target[valid] = delta[valid].to(output.dtype)
    return output


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x [T, in]``, ``lora_a [S, R, in]``, ``indices [T]`` -> ``[T, R]`` float32 (float64 for float64
    ``x``), zeros where -1."""
    groups = slot_groups(indices)
    if _dense(x.shape[0], lora_a.shape[0], lora_a.shape[1], len(groups)):
        return _shrink_dense(x, lora_a, indices, scale)
    return _shrink_groups(x, lora_a, groups, scale)


def bgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor, output: torch.Tensor,
                slice_offset: int = 0, add_inputs: bool = True) -> torch.Tensor:
    """``output[t, off:off+N] (+)= y[t] @ lora_b[slot].T`` for rows with a slot; returns ``output``."""
    groups = slot_groups(indices)
    if _dense(y.shape[0], lora_b.shape[0], lora_b.shape[2], len(groups)):
        return _expand_dense(y, lora_b, indices, output, slice_offset, add_inputs)
    return _expand_groups(y, lora_b, groups, output, slice_offset, add_inputs)


_LAST_SEGMENTS: list = [None, None]  # the last (starts, lens, slots) tensors (held, with copies) and their rows


def _segment_rows(num_rows: int, seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor
                  ) -> tuple[torch.Tensor, list[Group]]:
    """Each row's slot ``[T]`` (-1 outside every segment) and the rows of each slot (one GEMM
    pair per slot, not per segment: a mixed step's decode rows of one adapter are many segments)."""
    key = (seg_starts, seg_lens, seg_slots)
    last = _LAST_SEGMENTS[0]
    if last is not None and last[3] == num_rows and all(a is b and torch.equal(copy, b)
                                                         for (a, copy), b in zip(last[:3], key)):
        return _LAST_SEGMENTS[1]
    values = [-1] * num_rows
    for start, length, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()):
        values[start:start + length] = [slot] * length
    indices = torch.tensor(values, dtype=torch.int64, device=seg_starts.device)
    answer = (indices, _slot_groups(indices))
    _LAST_SEGMENTS[:] = [[*((t, t.clone()) for t in key), num_rows], answer]
    return answer


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """:func:`bgmv_shrink` with each row's slot given by segments (rows outside them: zeros)."""
    indices, groups = _segment_rows(x.shape[0], seg_starts, seg_lens, seg_slots)
    if _dense(x.shape[0], lora_a.shape[0], lora_a.shape[1], len(groups)):
        return _shrink_dense(x, lora_a, indices, scale)
    return _shrink_groups(x, lora_a, groups, scale)


def sgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, output: torch.Tensor, slice_offset: int = 0,
                add_inputs: bool = True) -> torch.Tensor:
    """:func:`bgmv_expand` with each row's slot given by segments."""
    indices, groups = _segment_rows(y.shape[0], seg_starts, seg_lens, seg_slots)
    if _dense(y.shape[0], lora_b.shape[0], lora_b.shape[2], len(groups)):
        return _expand_dense(y, lora_b, indices, output, slice_offset, add_inputs)
    return _expand_groups(y, lora_b, groups, output, slice_offset, add_inputs)


#: The ``"torch"`` LoRA kernel (the CPU fast path).
CPU_KERNEL = SimpleNamespace(name="torch", bgmv_shrink=bgmv_shrink, bgmv_expand=bgmv_expand,
                             sgmv_shrink=sgmv_shrink, sgmv_expand=sgmv_expand)
