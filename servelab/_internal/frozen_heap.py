"""Keep the objects alive at the start of a long loop out of the collector's full passes.

CPython's cyclic collector rescans every tracked object in its oldest
generation every so often; a process that has imported torch and built a
model holds a few hundred thousand of them, and one such pass took ~100 ms
inside a scheduler step of 1,024 requests (the step itself: ~1.5 ms). Serving
engines freeze their startup heap for that reason (vLLM after engine
start-up). A library shares its process with the user, so it freezes only
for the duration of one of its own loops (``Pipeline.generate``, the
simulator's run) and unfreezes at the end, and never when the process has
already frozen objects (their owner decides; ``gc.unfreeze`` would thaw
theirs too) or disabled the collector.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[bool]:
    """``gc.freeze()`` for the block, ``gc.unfreeze()`` after; yields whether it froze."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield False
        return
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()
