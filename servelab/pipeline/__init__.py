"""The pipeline: glue that turns the components into a serving engine.

- :mod:`~servelab.pipeline.detokenizer`: incremental detokenizer with stop strings.
"""

from servelab.pipeline.detokenizer import DetokenizerDelta, IncrementalDetokenizer

__all__ = ["DetokenizerDelta", "IncrementalDetokenizer"]
