"""Channels of the ``pd`` connector: how a prefill pipeline's KV reaches a decode pipeline.

A **transfer** is the KV of one finished prefill request: its first
``num_blocks`` full blocks, named by the request's block hashes (so a consumer
can check, block by block, that the KV is for *its* tokens before using it).
A transfer lives under a **lease**: the producer holds the blocks (its
scheduler's delayed free) until the consumer confirms it pulled them, or the
lease expires — then the producer revokes the transfer (a later pull fails:
the consumer recomputes) and frees the blocks. *Prefer leaking to misusing*:
nothing is freed while a pull may still read it.

- :class:`InProcessChannel`: producer and consumer pipelines in one process.
  The consumer copies straight from the producer's pool (no staging copy),
  under the channel's lock, which revocation also takes.
- :class:`DirectoryChannel`: two processes sharing a folder. The producer
  writes one file per block, then ``meta.json`` last (atomically renamed: a
  transfer is visible only once complete); the consumer reads the files and
  writes ``ack``; revocation deletes the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from servelab._internal.validation import check_number

__all__ = ["DirectoryChannel", "InProcessChannel", "TransferChannel"]

# reader(block index) -> the producer's tensors of that block (views), in layer order
Reader = Callable[[int], list[torch.Tensor]]
# writer(block index) -> the consumer's tensors to fill for that block, in the same order
Writer = Callable[[int], list[torch.Tensor]]


class TransferChannel:
    """What the ``pd`` connector needs of a channel (both implementations below)."""

    def publish(self, transfer_id: str, hashes: Sequence[bytes], reader: Reader, lease_s: float) -> None:
        raise NotImplementedError

    def describe(self, transfer_id: str) -> list[bytes] | None:
        """The block hashes of an open transfer, or None (unknown, revoked, expired)."""
        raise NotImplementedError

    def pull(self, transfer_id: str, indices: Sequence[int], writer: Writer) -> bool:
        """Copy blocks ``indices`` into ``writer``'s tensors; False if the transfer is not open."""
        raise NotImplementedError

    def confirm(self, transfer_id: str) -> None:
        """The consumer is done with the transfer (pulled it, or will not)."""
        raise NotImplementedError

    def settle(self, transfer_ids: Sequence[str]) -> set[str]:
        """Of the producer's ``transfer_ids``: those confirmed or expired, now revoked."""
        raise NotImplementedError


@dataclass
class _Entry:
    hashes: list[bytes]
    reader: Reader
    expires: float
    confirmed: bool = False


class InProcessChannel(TransferChannel):
    """Producer and consumer pipelines in one process (see the module docstring).

    Args:
        clock: seconds (leases); default ``time.monotonic``.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.bytes_pulled = 0

    def publish(self, transfer_id: str, hashes: Sequence[bytes], reader: Reader, lease_s: float) -> None:
        check_number("lease_s", lease_s, min_value=0.0)
        with self._lock:
            self._entries[transfer_id] = _Entry(list(hashes), reader, self.clock() + lease_s)

    def _open(self, transfer_id: str) -> _Entry | None:
        entry = self._entries.get(transfer_id)
        if entry is None or entry.confirmed or self.clock() >= entry.expires:
            return None
        return entry

    def describe(self, transfer_id: str) -> list[bytes] | None:
        with self._lock:
            entry = self._open(transfer_id)
            return None if entry is None else list(entry.hashes)

    def pull(self, transfer_id: str, indices: Sequence[int], writer: Writer) -> bool:
        with self._lock:  # revocation waits for the copy: the producer's blocks stay valid meanwhile
            entry = self._open(transfer_id)
            if entry is None:
                return False
            for i in indices:
                for dst, src in zip(writer(i), entry.reader(i), strict=True):
                    dst.copy_(src)
                    self.bytes_pulled += src.numel() * src.element_size()
            return True

    def confirm(self, transfer_id: str) -> None:
        with self._lock:
            entry = self._entries.get(transfer_id)
            if entry is not None:
                entry.confirmed = True

    def settle(self, transfer_ids: Sequence[str]) -> set[str]:
        done = set()
        with self._lock:
            now = self.clock()
            for tid in transfer_ids:
                entry = self._entries.get(tid)
                if entry is None or entry.confirmed or now >= entry.expires:
                    self._entries.pop(tid, None)
                    done.add(tid)
        return done


class DirectoryChannel(TransferChannel):
    """Two processes sharing ``directory`` (see the module docstring); leases use wall-clock time.

    Args:
        directory: the shared folder (created).
        clock: seconds since the epoch, the same on both sides (default ``time.time``).
    """

    def __init__(self, directory: str | os.PathLike, clock: Callable[[], float] = time.time) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.bytes_pulled = 0

    def _folder(self, transfer_id: str) -> Path:
        if not transfer_id or "/" in transfer_id or transfer_id.startswith("."):
            raise ValueError(f"transfer_id={transfer_id!r} must be a plain file name")
        return self.directory / transfer_id

    def publish(self, transfer_id: str, hashes: Sequence[bytes], reader: Reader, lease_s: float) -> None:
        check_number("lease_s", lease_s, min_value=0.0)
        folder = self._folder(transfer_id)
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(len(hashes)):
            torch.save([t.clone() for t in reader(i)], folder / f"{i}.pt")
        meta = {"hashes": [h.hex() for h in hashes], "expires": self.clock() + lease_s}
        tmp = folder / "meta.json.tmp"
        tmp.write_text(json.dumps(meta))
        tmp.replace(folder / "meta.json")  # visible only once every block file is written

    def _meta(self, transfer_id: str) -> dict[str, Any] | None:
        folder = self._folder(transfer_id)
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        if (folder / "ack").exists() or self.clock() >= meta["expires"]:
            return None
        return meta

    def describe(self, transfer_id: str) -> list[bytes] | None:
        meta = self._meta(transfer_id)
        return None if meta is None else [bytes.fromhex(h) for h in meta["hashes"]]

    def pull(self, transfer_id: str, indices: Sequence[int], writer: Writer) -> bool:
        if self._meta(transfer_id) is None:
            return False
        folder = self._folder(transfer_id)
        try:
            payloads = {i: torch.load(folder / f"{i}.pt", weights_only=True) for i in indices}
        except (OSError, RuntimeError, EOFError):
            return False  # revoked (deleted) while reading: recompute
        for i, payload in payloads.items():
            for dst, src in zip(writer(i), payload, strict=True):
                dst.copy_(src)
                self.bytes_pulled += src.numel() * src.element_size()
        return True

    def confirm(self, transfer_id: str) -> None:
        folder = self._folder(transfer_id)
        if folder.exists():
            (folder / "ack").touch()

    def settle(self, transfer_ids: Sequence[str]) -> set[str]:
        done = set()
        now = self.clock()
        for tid in transfer_ids:
            folder = self._folder(tid)
            try:
                meta = json.loads((folder / "meta.json").read_text())
                expired = now >= meta["expires"]
            except (OSError, ValueError):
                expired = True
            if expired or (folder / "ack").exists():
                shutil.rmtree(folder, ignore_errors=True)
                done.add(tid)
        return done
