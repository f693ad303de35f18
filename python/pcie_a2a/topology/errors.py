"""Errors raised while reading or checking a topology."""

from __future__ import annotations


class TopologyError(ValueError):
    """A topology source is garbled or inconsistent. The message names the file, the line
    (when there is one) and what was expected."""


def parse_error(source: str, line: int | None, msg: str) -> TopologyError:
    where = f"{source}:{line}" if line is not None else source
    return TopologyError(f"{where}: {msg}")
