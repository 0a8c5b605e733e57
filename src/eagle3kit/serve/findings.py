"""What ``check`` reports: one :class:`Finding` per fault (shared by every drafter kind's checks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Finding:
    """One fault: ``code`` (stable name), ``message`` (what is wrong, with both values), ``fix``,
    ``severity`` (``error``: the server would fail or run a broken drafter; ``warning``: not
    checked or not certain; ``info``: what was verified, for the record)."""

    code: str
    message: str
    fix: str
    severity: str = "error"
