"""Workloads for the simulator: when requests arrive, how long they are, who sent them.

A workload is a list of :class:`TraceRequest` sorted by arrival time, either
generated from a :class:`WorkloadSpec` (seeded: the same spec gives the same
requests, token for token) or read from a CSV trace.

Length distributions are written as short strings (CLI) or built directly:
``"fixed:512"``, ``"uniform:64:1024"`` (inclusive), ``"lognormal:512:0.8"``
(median, sigma; clipped to [1, 32768]).
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAX_SAMPLED_LEN = 32768


_INT_OBJECTS = np.arange(0, dtype=object)


def _shared_ints(ids: np.ndarray) -> list[int]:
    """``ids.tolist()`` with one shared ``int`` object per token id: a live prompt's list then
    costs 8 bytes a token instead of 36 (an overloaded run keeps most of its requests waiting)."""
    global _INT_OBJECTS
    if len(ids) and int(ids.max()) >= len(_INT_OBJECTS):
        _INT_OBJECTS = np.array(list(range(max(int(ids.max()) + 1, 2 * len(_INT_OBJECTS)))), dtype=object)
    return _INT_OBJECTS[ids].tolist()


class PrefixedTokens(Sequence[int]):
    """A generated prompt, compact: a shared prefix (a list, one per prefix group) followed by
    ``tokens[start:end]`` of the workload's one token array (int32).

    A million generated prompts of ~770 tokens as Python lists would take ~27 GB; as views of
    one int32 array they take ~3 GB. ``list(prompt)`` materialises it (the simulator does so
    only while the request is live), and slices come back as lists.
    """

    __slots__ = ("prefix", "tokens", "start", "end")
    #: ``Request`` skips its per-token check for this type: the prefix and the token array are
    #: drawn here from ``[0, vocab_size)`` (checking ~512 ids again per request was ~3% of a run).
    holds_checked_token_ids = True

    def __init__(self, prefix: list[int], tokens: np.ndarray, start: int, end: int) -> None:
        self.prefix, self.tokens, self.start, self.end = prefix, tokens, start, end

    def __len__(self) -> int:
        return len(self.prefix) + self.end - self.start

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.prefix, _shared_ints(self.tokens[self.start:self.end]))

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return list(self)[index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"token index {index} out of range for a prompt of {n} tokens")
        k = len(self.prefix)
        return self.prefix[index] if index < k else int(self.tokens[self.start + index - k])

    def __eq__(self, other) -> bool:
        if isinstance(other, (PrefixedTokens, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PrefixedTokens({len(self.prefix)} prefix + {self.end - self.start} tokens)"


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts: ``fixed``, ``uniform`` or ``lognormal``."""

    kind: str = "fixed"
    a: float = 256
    """fixed: the value; uniform: low; lognormal: median."""
    b: float = 0
    """uniform: high (inclusive); lognormal: sigma of the log."""

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"LengthDist.kind={self.kind!r}; valid: fixed, uniform, lognormal")
        if self.a < 1 or (self.kind == "uniform" and self.b < self.a) or (self.kind == "lognormal" and self.b < 0):
            raise ValueError(f"LengthDist {self} is invalid: lengths are >= 1, uniform needs low <= high, "
                             "lognormal needs sigma >= 0")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``"512"``, ``"fixed:512"``, ``"uniform:64:1024"`` or ``"lognormal:512:0.8"``."""
        parts = str(text).split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            if parts[0] == "fixed" and len(parts) == 2:
                return cls("fixed", int(parts[1]))
            if parts[0] in ("uniform", "lognormal") and len(parts) == 3:
                return cls(parts[0], float(parts[1]), float(parts[2]))
        except ValueError as exc:
            raise ValueError(f"length distribution {text!r}: {exc}") from None
        raise ValueError(f"length distribution {text!r} is not one of fixed:N, uniform:LOW:HIGH, "
                         "lognormal:MEDIAN:SIGMA")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b) + 1, size=n)
        values = np.exp(rng.normal(math.log(self.a), self.b, size=n))
        return np.clip(np.rint(values), 1, MAX_SAMPLED_LEN).astype(np.int64)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload.

    ``prompt_token_ids`` is any sequence of token ids: a list, or a compact
    one (a ``range``, a :class:`.traces.BlockTokens`) for long real traces; the
    simulator makes a list of it only while the request is live.
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: Sequence[int]
    max_tokens: int
    client_id: str = "default"
    priority: int = 0
    lora_name: str | None = None  # a LoRA adapter: the scheduler's max_loras constraint applies (servelab.lora)


@dataclass(frozen=True)
class WorkloadSpec:
    """A synthetic workload.

    Attributes:
        num_requests: how many requests.
        rate: mean arrivals per second; ``inf`` puts every arrival at t=0.
        arrival: ``"poisson"`` (exponential gaps) or ``"gamma"`` (gamma gaps
            with shape ``burstiness``: < 1 is burstier than Poisson, > 1
            smoother; the mean gap stays ``1/rate``).
        prompt_len, output_len: lengths (the prompt length excludes a shared
            prefix); outputs end by ``max_tokens``.
        num_prefix_groups, prefix_len: shared system prompts — each request
            starts with one of ``num_prefix_groups`` prefixes of ``prefix_len``
            tokens (0 groups: none).
        num_clients: clients sending requests; ``client_weights`` (one per
            client) gives their shares of the requests, default equal. Each
            client may have its own length scale via ``client_length_scale``
            (multiplies prompt and output lengths; fairness studies).
        num_priorities: priorities drawn uniformly from ``range(num_priorities)``.
        seed: everything random derives from it.
    """

    num_requests: int = 1000
    rate: float = 10.0
    arrival: str = "poisson"
    burstiness: float = 1.0
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("lognormal", 512, 0.6))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("lognormal", 128, 0.6))
    num_prefix_groups: int = 0
    prefix_len: int = 0
    num_clients: int = 1
    client_weights: tuple[float, ...] | None = None
    client_length_scale: tuple[float, ...] | None = None
    num_priorities: int = 1
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_clients", "num_priorities", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"WorkloadSpec.{name}={getattr(self, name)!r} must be an int >= 1")
        for name in ("num_prefix_groups", "prefix_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"WorkloadSpec.{name}={getattr(self, name)!r} must be an int >= 0")
        if not self.rate > 0:
            raise ValueError(f"WorkloadSpec.rate={self.rate!r} must be > 0 (inf: all at once)")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"WorkloadSpec.arrival={self.arrival!r}; valid: poisson, gamma")
        if not self.burstiness > 0:
            raise ValueError(f"WorkloadSpec.burstiness={self.burstiness!r} must be > 0")
        if (self.num_prefix_groups > 0) != (self.prefix_len > 0):
            raise ValueError("WorkloadSpec.num_prefix_groups and prefix_len must be both 0 or both > 0")
        for name in ("client_weights", "client_length_scale"):
            value = getattr(self, name)
            if value is not None and (len(value) != self.num_clients or min(value) <= 0):
                raise ValueError(f"WorkloadSpec.{name} must hold num_clients={self.num_clients} positive numbers")


def generate_workload(spec: WorkloadSpec) -> list[TraceRequest]:
    """The requests of ``spec``, sorted by arrival; reproducible from its seed (a list of
    :func:`iter_workload`)."""
    return list(iter_workload(spec))


def iter_workload(spec: WorkloadSpec) -> Iterator[TraceRequest]:
    """The requests of ``spec`` in arrival order, generated as they are read: the per-request
    numbers are drawn up front (a few arrays of ``num_requests``), the prompts' token ids a chunk
    at a time, so a million-request workload never holds every prompt."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    if math.isinf(spec.rate):
        arrivals = np.zeros(n)
    elif spec.arrival == "poisson":
        arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, size=n))
    else:
        shape = spec.burstiness
        arrivals = np.cumsum(rng.gamma(shape, 1.0 / (spec.rate * shape), size=n))
    weights = np.asarray(spec.client_weights or [1.0] * spec.num_clients, dtype=float)
    clients = rng.choice(spec.num_clients, size=n, p=weights / weights.sum())
    scale = np.asarray(spec.client_length_scale or [1.0] * spec.num_clients, dtype=float)[clients]
    prompt_lens = np.maximum(np.rint(spec.prompt_len.sample(rng, n) * scale), 1).astype(np.int64)
    output_lens = np.maximum(np.rint(spec.output_len.sample(rng, n) * scale), 1).astype(np.int64)
    priorities = rng.integers(0, spec.num_priorities, size=n)
    groups = rng.integers(0, max(spec.num_prefix_groups, 1), size=n)
    prefixes = [rng.integers(0, spec.vocab_size, size=spec.prefix_len).tolist()
                for _ in range(spec.num_prefix_groups)]
    # Token ids a chunk of requests at a time (the same stream as one draw of every token), in the
    # smallest dtype that holds the vocabulary: a chunk lives while one of its prompts does.
    dtype = np.uint16 if spec.vocab_size <= 1 << 16 else np.int32
    no_prefix: list[int] = []
    arrival_list, output_list = arrivals.tolist(), output_lens.tolist()
    client_names = [f"client-{c}" for c in range(spec.num_clients)]
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        bounds = np.concatenate([[0], np.cumsum(prompt_lens[lo:hi])]).tolist()
        tokens = rng.integers(0, spec.vocab_size, size=bounds[-1]).astype(dtype)
        for k, i in enumerate(range(lo, hi)):
            prompt = PrefixedTokens(prefixes[groups[i]] if prefixes else no_prefix, tokens, bounds[k], bounds[k + 1])
            yield TraceRequest(f"req-{i}", arrival_list[i], prompt, output_list[i], client_names[clients[i]],
                               int(priorities[i]))


_CHUNK = 4096


def validate_trace(requests: Sequence[TraceRequest]) -> None:
    """Check a workload before simulating it: ``ValueError`` naming the request and the field.

    Arrival times must be finite numbers >= 0 (a NaN arrival would never be
    reached by the clock), prompts non-empty lists of token ids >= 0,
    ``max_tokens`` an int >= 1, request ids unique.
    """
    seen: set[str] = set()
    for i, r in enumerate(requests):
        _check_request(i, r, seen)


def _check_request(i: int, r: TraceRequest, seen: set[str]) -> None:
    """:func:`validate_trace`'s checks of ``workload[i]`` (adds its id to ``seen``)."""
    if not isinstance(r, TraceRequest):
        raise TypeError(f"workload[{i}] is a {type(r).__name__}; valid: TraceRequest")
    where = f"workload[{i}] (request {r.request_id!r})"
    t = r.arrival_time
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise ValueError(f"{where}: arrival_time={t!r}; valid: a finite number >= 0 (seconds)")
    if not r.prompt_token_ids:
        raise ValueError(f"{where}: empty prompt; valid: at least one token")
    if isinstance(r.max_tokens, bool) or not isinstance(r.max_tokens, int) or r.max_tokens < 1:
        raise ValueError(f"{where}: max_tokens={r.max_tokens!r}; valid: an int >= 1")
    if r.request_id in seen:
        raise ValueError(f"{where}: duplicate request_id; valid: unique ids")
    seen.add(r.request_id)


def arrival_stream(workload: WorkloadSpec | Iterable[TraceRequest]) -> Iterator[TraceRequest]:
    """The requests of ``workload`` in arrival order, for the simulator to read lazily.

    A :class:`WorkloadSpec` is generated as it is read (:func:`iter_workload`;
    nothing to validate). A sequence (a list) is validated whole
    (:func:`validate_trace`) and sorted by arrival. Any other iterable (a
    generator: a trace too big to hold) is validated request by request as it
    is read and must already be in arrival order: ``ValueError`` naming the
    first request that arrives before the one read before it.
    """
    if isinstance(workload, WorkloadSpec):
        return iter_workload(workload)
    if isinstance(workload, Sequence):
        requests = list(workload)
        validate_trace(requests)
        return iter(sorted(requests, key=lambda r: r.arrival_time))
    if not isinstance(workload, Iterable):
        raise TypeError(f"workload must be a WorkloadSpec or an iterable of TraceRequest, got {type(workload).__name__}")
    return _checked_stream(iter(workload))


def _checked_stream(stream: Iterator[TraceRequest]) -> Iterator[TraceRequest]:
    seen: set[str] = set()
    last = -math.inf
    for i, r in enumerate(stream):
        _check_request(i, r, seen)
        if r.arrival_time < last:
            raise ValueError(f"workload[{i}] (request {r.request_id!r}) arrives at {r.arrival_time!r}, before the "
                             f"request read before it ({last!r}); valid: a stream in arrival order (or pass a list)")
        last = r.arrival_time
        yield r


def _cell(path, line: int, row: dict, column: str, kind: type, *, minimum: float, default=None):
    """One parsed cell of a trace row; ``ValueError`` naming the file, line, column and value."""
    value = row.get(column)
    if value is None or value == "":
        if default is not None:
            return default
        raise ValueError(f"trace {path} line {line}: column {column!r} is empty or missing (short row?)")
    try:
        parsed = kind(value) if kind is float else int(value.strip())
    except ValueError:
        raise ValueError(f"trace {path} line {line}: column {column!r} = {value!r} is not "
                         f"{'a number' if kind is float else 'an integer'}") from None
    if (kind is float and not math.isfinite(parsed)) or parsed < minimum:
        raise ValueError(f"trace {path} line {line}: column {column!r} = {value!r}; valid: a finite "
                         f"{'number' if kind is float else 'integer'} >= {minimum:g}")
    return parsed


def load_trace_csv(path: str | Path, *, rate: float | None = None, seed: int = 0,
                   vocab_size: int = 32000) -> list[TraceRequest]:
    """Read a trace: one request per row, a header naming the columns.

    Required: ``prompt_len`` (or ``input_len``) and ``output_len``. Optional:
    ``arrival_time`` (seconds; without it arrivals are Poisson at ``rate``),
    ``client_id``, ``priority``, ``prefix_group`` and ``prefix_len`` (rows with
    the same group share their first ``prefix_len`` tokens). Token ids are
    random (seeded): a trace gives lengths, not content.

    Every cell is checked before anything is simulated: lengths are integers
    >= 1, ``arrival_time`` a finite number >= 0, ``priority`` an integer,
    ``prefix_len`` an integer >= 0; a row with fewer cells than the header, or
    more, is refused. Errors are ``ValueError`` naming the file, the line and
    the column.
    """
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        header = reader.fieldnames or []
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    prompt_col = "prompt_len" if "prompt_len" in header else "input_len"
    for col in (prompt_col, "output_len"):
        if col not in header:
            raise ValueError(f"trace {path} lacks a {col!r} column (has {sorted(header)})")
    for i, row in enumerate(rows):
        if None in row:
            raise ValueError(f"trace {path} line {i + 2}: {len(header) + len(row[None])} cells, the header has "
                             f"{len(header)}")
    has_arrival = "arrival_time" in header
    rng = np.random.default_rng(seed)
    if not has_arrival:
        if rate is None:
            raise ValueError(f"trace {path} has no arrival_time column; pass rate= to draw Poisson arrivals")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError(f"rate={rate!r} is invalid for trace {path} (no arrival_time column); valid: a "
                             "number > 0 (inf: all at once)")
        gaps = rng.exponential(1.0 / rate, size=len(rows)) if not math.isinf(rate) else np.zeros(len(rows))
        arrivals = np.cumsum(gaps)
    parsed = []
    for i, row in enumerate(rows):
        line = i + 2
        prompt_len = _cell(path, line, row, prompt_col, int, minimum=1)
        output_len = _cell(path, line, row, "output_len", int, minimum=1)
        arrival = (_cell(path, line, row, "arrival_time", float, minimum=0) if has_arrival
                   else float(arrivals[i]))
        priority = _cell(path, line, row, "priority", int, minimum=-(2 ** 62), default=0)
        prefix_len = _cell(path, line, row, "prefix_len", int, minimum=0, default=0)
        parsed.append((prompt_len, output_len, arrival, priority, prefix_len))
    group_prefix: dict[str, list[int]] = {}
    out = []
    for i, (row, (prompt_len, output_len, arrival, priority, prefix_len)) in enumerate(zip(rows, parsed)):
        prompt = rng.integers(0, vocab_size, size=prompt_len).tolist()
        group = row.get("prefix_group") or ""
        if group:
            plen = min(prefix_len, prompt_len)
            shared = group_prefix.setdefault(group, [])
            if len(shared) < plen:
                shared.extend(rng.integers(0, vocab_size, size=plen - len(shared)).tolist())
            prompt[:plen] = shared[:plen]
        out.append(TraceRequest(f"req-{i}", arrival, prompt, output_len, row.get("client_id") or "default",
                                priority))
    out.sort(key=lambda r: r.arrival_time)
    return out
