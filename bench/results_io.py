"""The benchmarks' name for :mod:`servelab.results` (one row schema, one CSV file).

Benchmarks run as scripts from ``bench/`` and import ``results_io``; the writer
itself lives in the package so the CLI (``servelab simulate``, ``servelab sweep``)
writes the same rows.
"""

from servelab.results import (  # noqa: F401
    COLUMNS,
    ENV_PATH,
    NUMERIC,
    RESULTS_CSV,
    append_rows,
    git_sha,
    library_versions,
    make_row,
    percentiles,
    read_rows,
    resolve_path,
    versions_of_python,
)
