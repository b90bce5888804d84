"""Real serving traces for the simulator: Mooncake (FAST'25) and Azure (Splitwise, ISCA'24).

:func:`load_trace` reads a trace file (or a shipped trace by name) into
:class:`~servelab.scheduling.simulator.workload.TraceRequest` s sorted by arrival.

- ``"mooncake"``: JSON lines ``{"timestamp": ms, "input_length", "output_length",
  "hash_ids": [...]}``. Each hash id stands for :data:`MOONCAKE_BLOCK_TOKENS`
  (512) tokens; the prompt is synthesised so that the trace's prefix sharing is
  reproduced exactly: hash id ``h`` always becomes the tokens
  ``h * 512 + j`` for ``j`` in ``0..511`` (the same id gives the same tokens, two
  different ids differ from their first token on). The last block is partial
  when ``input_length`` is not a multiple of 512. Block sizes that divide 512
  then see exactly the trace's reusable prefixes.
- ``"azure"``: CSV ``TIMESTAMP, ContextTokens, GeneratedTokens`` with wall-clock
  timestamps (``2023-11-16 18:15:46.6805900``); arrivals become seconds after the
  first. The trace has no prefix information: every prompt gets tokens no other
  prompt shares.
- ``"csv"``: servelab's own CSV trace (:func:`.workload.load_trace_csv`; an
  ``arrival_time`` column is required).

Prompts are kept compact (:class:`BlockTokens`, ``range``): the Mooncake trace
holds 12,031 prompts of ~12k tokens, which as Python lists would take GBs; the
simulator turns a prompt into a list only while its request is live.

Shipped traces (package data, with their licenses, in ``servelab/data/traces``):
``"mooncake_conversation"`` and ``"azure_conv"``.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

from servelab.scheduling.simulator.workload import TraceRequest, load_trace_csv

logger = logging.getLogger(__name__)

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per Mooncake ``hash_ids`` entry."""

FORMATS = ("mooncake", "azure", "csv")

SHIPPED_TRACES = {
    "mooncake_conversation": ("mooncake_conversation_trace.jsonl", "mooncake"),
    "azure_conv": ("azure_llm_2023_conv.csv", "azure"),
}
"""Shipped trace name -> (file in ``servelab/data/traces``, format)."""


class BlockTokens(Sequence[int]):
    """The synthetic prompt of a Mooncake request: ``length`` tokens of 512-token blocks.

    Token ``j`` of block ``h`` is ``h * 512 + j``. Immutable and O(len(hash_ids))
    in memory; ``list(tokens)`` materialises it (at C speed: a chain of ranges).
    """

    __slots__ = ("hash_ids", "length")

    def __init__(self, hash_ids: Sequence[int], length: int) -> None:
        if length > len(hash_ids) * MOONCAKE_BLOCK_TOKENS or length < 1:
            raise ValueError(f"length={length} does not fit {len(hash_ids)} blocks of {MOONCAKE_BLOCK_TOKENS} "
                             "tokens; valid: 1 <= length <= 512 * len(hash_ids)")
        self.hash_ids = tuple(hash_ids)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def _blocks(self) -> Iterator[range]:
        bs = MOONCAKE_BLOCK_TOKENS
        for i, h in enumerate(self.hash_ids):
            n = min(bs, self.length - i * bs)
            if n <= 0:
                return
            yield range(h * bs, h * bs + n)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._blocks())

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += self.length
        if not 0 <= index < self.length:
            raise IndexError(f"token index {index} out of range for a prompt of {self.length} tokens")
        block, offset = divmod(index, MOONCAKE_BLOCK_TOKENS)
        return self.hash_ids[block] * MOONCAKE_BLOCK_TOKENS + offset

    def __eq__(self, other) -> bool:
        if isinstance(other, BlockTokens):
            return self.length == other.length and self.hash_ids[:self.num_blocks] == other.hash_ids[:other.num_blocks]
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.hash_ids[:self.num_blocks], self.length))

    @property
    def num_blocks(self) -> int:
        """Blocks the tokens touch (the last may be partial)."""
        return -(-self.length // MOONCAKE_BLOCK_TOKENS)

    def __repr__(self) -> str:
        return f"BlockTokens({self.length} tokens, {self.num_blocks} blocks)"


class Trace(list):
    """A ``list[TraceRequest]`` that also says where it came from and what loading changed.

    Attributes:
        source: the file read.
        format: ``"mooncake"``, ``"azure"`` or ``"csv"``.
        num_clipped: requests shortened to fit ``max_model_len``.
    """

    def __init__(self, requests, source: str = "", format: str = "", num_clipped: int = 0) -> None:
        super().__init__(requests)
        self.source = source
        self.format = format
        self.num_clipped = num_clipped


def shipped_trace_path(name: str) -> Path:
    """The packaged file of a shipped trace (``"mooncake_conversation"``, ``"azure_conv"``)."""
    if name not in SHIPPED_TRACES:
        raise ValueError(f"trace {name!r} is not shipped; valid: {', '.join(SHIPPED_TRACES)}")
    return Path(str(resources.files("servelab") / "data" / "traces" / SHIPPED_TRACES[name][0]))


def infer_trace_format(path: str | Path) -> str:
    """The format of a trace named by ``path`` alone, the same rule as ``servelab simulate``: a
    shipped trace's own, ``.jsonl`` / ``.json`` Mooncake, anything else servelab's CSV (an Azure
    CSV must be named with ``format="azure"``)."""
    if isinstance(path, str) and path in SHIPPED_TRACES:
        return SHIPPED_TRACES[path][1]
    return "mooncake" if Path(path).suffix.lower() in (".jsonl", ".json") else "csv"


def load_trace(path: str | Path, format: str | None = None, *, time_scale: float = 1.0,
               max_model_len: int | None = None) -> Trace:
    """Read a trace into requests sorted by arrival (seconds, the first arrival at its own offset).

    Args:
        path: a trace file, or a shipped trace's name (``"mooncake_conversation"``,
            ``"azure_conv"``; ``format`` then must be left out or be the trace's own).
        format: ``"mooncake"``, ``"azure"`` or ``"csv"``; None infers it
            (:func:`infer_trace_format`: ``.jsonl`` Mooncake, else CSV).
        time_scale: every arrival time is multiplied by it (0.5 replays the trace
            twice as fast; 2.0 half as fast).
        max_model_len: requests longer than this are clipped, not dropped: the
            prompt to its first ``max_model_len - 1`` tokens (the shared prefix is
            kept), ``max_tokens`` to what is left. The count is
            ``Trace.num_clipped`` (also logged).

    Returns:
        a :class:`Trace` (a ``list[TraceRequest]``); ids are ``req-<row>``.

    Raises ``ValueError`` naming the file, line and field for a malformed row,
    an unknown format or a bad ``time_scale`` / ``max_model_len``.
    """
    if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or not (
            math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale={time_scale!r} is invalid; valid: a finite number > 0")
    if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                      or max_model_len < 2):
        raise ValueError(f"max_model_len={max_model_len!r} is invalid; valid: None or an int >= 2")
    if isinstance(path, str) and path in SHIPPED_TRACES:
        own = SHIPPED_TRACES[path][1]
        if format is not None and format != own:
            raise ValueError(f"format={format!r} contradicts the shipped trace {path!r}, which is {own!r}; "
                             "leave format out")
        format = own
        path = shipped_trace_path(path)
    if format is None:
        format = infer_trace_format(path)
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is invalid; valid: {', '.join(FORMATS)}")
    if not Path(path).is_file():
        raise ValueError(f"trace {str(path)!r} is not a file nor a shipped trace name; shipped: "
                         f"{', '.join(SHIPPED_TRACES)}")
    if format == "mooncake":
        requests = _read_mooncake(path)
    elif format == "azure":
        requests = _read_azure(path)
    else:
        requests = load_trace_csv(path)
    requests.sort(key=lambda r: r.arrival_time)
    out, clipped = [], 0
    for r in requests:
        prompt, max_tokens = r.prompt_token_ids, r.max_tokens
        if max_model_len is not None and len(prompt) + max_tokens > max_model_len:
            clipped += 1
            if len(prompt) >= max_model_len:
                prompt = _clip(prompt, max_model_len - 1)
            max_tokens = max_model_len - len(prompt)
        out.append(TraceRequest(r.request_id, r.arrival_time * time_scale, prompt, max_tokens, r.client_id,
                                r.priority))
    if clipped:
        logger.info("trace %s: %d of %d requests clipped to max_model_len=%d", path, clipped, len(out),
                    max_model_len)
    return Trace(out, str(path), format, clipped)


def _clip(prompt: Sequence[int], n: int) -> Sequence[int]:
    if isinstance(prompt, BlockTokens):
        return BlockTokens(prompt.hash_ids[: -(-n // MOONCAKE_BLOCK_TOKENS)], n)
    return prompt[:n]


def _bad(path, line: int, what: str) -> ValueError:
    return ValueError(f"trace {path} line {line}: {what}")


def _positive_int(path, line: int, row: dict, key: str, minimum: int) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(path, line, f"{key}={value!r}; valid: an int >= {minimum}")
    return value


def _read_mooncake(path) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _bad(path, line_no, f"not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise _bad(path, line_no, "not a JSON object")
            stamp = row.get("timestamp")
            if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not (
                    math.isfinite(stamp) and stamp >= 0):
                raise _bad(path, line_no, f"timestamp={stamp!r}; valid: milliseconds >= 0")
            n_in = _positive_int(path, line_no, row, "input_length", 1)
            n_out = _positive_int(path, line_no, row, "output_length", 1)
            ids = row.get("hash_ids")
            if not isinstance(ids, list) or not all(type(h) is int and h >= 0 for h in ids):
                raise _bad(path, line_no, f"hash_ids={ids!r:.80}; valid: a list of ints >= 0")
            if -(-n_in // MOONCAKE_BLOCK_TOKENS) != len(ids):
                raise _bad(path, line_no, f"input_length={n_in} needs {-(-n_in // MOONCAKE_BLOCK_TOKENS)} "
                                          f"hash_ids of {MOONCAKE_BLOCK_TOKENS} tokens, the row has {len(ids)}")
            out.append(TraceRequest(f"req-{len(out)}", stamp / 1000.0, BlockTokens(ids, n_in), n_out))
    if not out:
        raise ValueError(f"trace {path} has no rows")
    return out


def _parse_wall_clock(text: str) -> float:
    """``"2023-11-16 18:15:46.6805900"`` -> POSIX seconds (fractions beyond microseconds kept)."""
    whole, _, frac = text.strip().partition(".")
    seconds = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    return seconds + (float("0." + frac) if frac else 0.0)


def _read_azure(path) -> list[TraceRequest]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        header = reader.fieldnames or []
    for col in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"):
        if col not in header:
            raise ValueError(f"trace {path} lacks a {col!r} column (has {sorted(header)})")
    stamps, lengths = [], []
    for i, row in enumerate(rows):
        line = i + 2
        try:
            stamps.append(_parse_wall_clock(row["TIMESTAMP"] or ""))
        except ValueError:
            raise _bad(path, line, f"TIMESTAMP={row['TIMESTAMP']!r}; valid: 'YYYY-MM-DD HH:MM:SS[.fraction]'") from None
        pair = []
        for col in ("ContextTokens", "GeneratedTokens"):
            try:
                value = int((row[col] or "").strip())
            except ValueError:
                value = 0
            if value < 1:
                raise _bad(path, line, f"{col}={row[col]!r}; valid: an int >= 1")
            pair.append(value)
        lengths.append(pair)
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    start = min(stamps)
    out: list[TraceRequest] = []
    offset = 0
    for i, (stamp, (n_in, n_out)) in enumerate(zip(stamps, lengths)):
        # Disjoint token ranges: no prompt shares a prefix with another (the trace has no prefix information).
        out.append(TraceRequest(f"req-{i}", stamp - start, range(offset, offset + n_in), n_out))
        offset += n_in
    return out
