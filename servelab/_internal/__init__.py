"""Private helpers shared by the fast paths and the references.

Argument checks, sampling noise and draft layout live here, not in
:mod:`servelab.reference`, so that no fast-path module imports the
references (the references are the spec; they import from here too).
Nothing in this package is public API.
"""
