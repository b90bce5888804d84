"""Shared option plumbing of the ``servelab`` console script.

Three rules every subcommand follows, kept here so that they are one rule:

- **Outputs are checked before the run** (:func:`check_out_dir`,
  :func:`check_out_file`): a folder that is a file, a path that cannot be
  created or written, a results CSV with another header are refused with one
  line *before* minutes of work are done, not after (and without creating
  anything: the writers create what they write).
- **Nothing is silently ignored** (:func:`explicit_options`): a subcommand
  learns which options the user actually typed (not the defaults) and refuses
  those that do not apply to the chosen mode, so nothing is recorded as used
  that had no effect.
- **Every option shows its default** (:class:`DefaultsHelpFormatter`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DefaultsHelpFormatter", "OutputError", "check_out_dir", "check_out_file", "explicit_options"]


class OutputError(ValueError):
    """An output path the command could not write (raised before the run)."""


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to every option's help that does not state its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or isinstance(
                action, (argparse._StoreTrueAction, argparse._HelpAction)) or not action.option_strings:
            return text
        return f"{text} (default: {action.default})" if text else f"(default: {action.default})"


def explicit_options(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The ``dest`` names of the options present on the command line ``argv`` (defaults excluded).

    Parses ``argv`` a second time with every default switched to
    ``argparse.SUPPRESS``: what comes back was typed. The parser's defaults are
    restored afterwards. ``argv`` must already have parsed successfully.
    """
    saved: list[tuple[argparse.Action, object]] = []
    parsers = [parser]
    while parsers:
        current = parsers.pop()
        for action in current._actions:
            saved.append((action, action.default))
            action.default = argparse.SUPPRESS
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    try:
        namespace = parser.parse_args(argv)
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(namespace))


def _probe_writable(folder: Path, option: str) -> None:
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".servelab-probe-"):
            pass
    except OSError as exc:
        raise OutputError(f"{option} {str(folder)!r} is not writable ({exc.strerror or exc}); "
                          "give a folder you can write to") from None


def check_out_dir(path: str | os.PathLike, option: str = "--out") -> Path:
    """Prove that the output folder ``path`` can be written, without creating it; raise
    :class:`OutputError` otherwise (a refused run leaves nothing behind; the writers create it).

    Refused: an existing file (not a folder), an existing folder that cannot be written, a missing
    folder whose nearest existing ancestor is a file or cannot be written.
    """
    folder = Path(path)
    if folder.exists():
        if not folder.is_dir():
            raise OutputError(f"{option} {str(folder)!r} is a file, not a folder; give a folder (it is created if "
                              "missing)")
        _probe_writable(folder, option)
        return folder
    ancestor = folder.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{option} {str(folder)!r} cannot be created: {str(ancestor)!r} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {str(folder)!r} cannot be created: {str(ancestor)!r} is not writable; give a "
                          "folder you can write to")
    return folder


def check_out_file(path: str | os.PathLike, option: str, *, results_csv: bool = False) -> Path:
    """Check that file ``path`` can be written (its folder created now); a results CSV's header must match.

    Raises :class:`OutputError` for a folder in its place, an unwritable file
    or folder, or (``results_csv``) an existing file whose header is not
    :data:`servelab.results.COLUMNS`.
    """
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{option} {str(target)!r} is a folder; give a file path")
    check_out_dir(target.parent if str(target.parent) else Path("."), option=f"{option}'s folder")
    if target.exists():
        if not os.access(target, os.W_OK):
            raise OutputError(f"{option} {str(target)!r} is not writable; give a file you can write to")
        if results_csv:
            from servelab.results import check_results_file

            try:
                check_results_file(target)
            except ValueError as exc:
                raise OutputError(f"{option}: {exc}") from None
    return target
