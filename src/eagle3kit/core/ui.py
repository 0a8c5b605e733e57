"""Console output: one progress bar style (rows, tokens/s, ETA) and summary tables, via rich."""

from __future__ import annotations

import math
import os
import sys
import threading
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

# a long path is never folded mid-name (file:line stays copyable); written to a log or a pipe, which has
# no width, rich would cut each progress line at 80 columns ("0:00:… ETA 0:00:…"): 160 keeps it whole
# unless COLUMNS says otherwise
console = Console(
    stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() or "COLUMNS" in os.environ else 160
)


class _TokensPerSecond(ProgressColumn):
    def render(self, task) -> Text:
        tokens = task.fields.get("tokens", 0)
        elapsed = task.elapsed or 0.0
        rate = tokens / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:,.0f} tok/s", style="cyan")


#: seconds between the progress lines written to a log (a console that is not a terminal)
LOG_EVERY_S = float(os.environ.get("EAGLE3KIT_PROGRESS_EVERY", "30"))


def _clock(seconds: float | None) -> str:
    """``h:mm:ss``; ``?`` for an unknown, negative, non-finite or over-99-hour value."""
    if seconds is None or not math.isfinite(seconds) or not 0 <= seconds < 100 * 3600:
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def eta_seconds(task) -> float | None:
    """Seconds left of a rich task: rich's estimate from its recent steps, else (no step in rich's window,
    as when a stage advances in large batches) the rate since the start, ``(total − done) · elapsed /
    done``; None before the first step or without a finite total, never negative."""
    if not task.total or not math.isfinite(task.total):
        return None
    rich_eta = task.time_remaining
    if rich_eta is not None and math.isfinite(rich_eta) and rich_eta >= 0:
        return rich_eta
    elapsed = task.elapsed or 0.0
    if task.completed <= 0 or elapsed <= 0:
        return None
    return max(task.total - task.completed, 0) * elapsed / task.completed


def progress_line(task) -> str:
    """One line for a log: ``description: done/total (pct), tokens/s, elapsed, ETA`` of a rich task
    (``tokens`` task field: tokens so far; ETA from :func:`eta_seconds`, ``?`` before a step is done)."""
    elapsed = task.elapsed or 0.0
    tokens = task.fields.get("tokens", 0)
    finite = bool(task.total) and math.isfinite(task.total)
    total = f"/{task.total:,.0f}" if finite else ""
    pct = f" ({100 * task.completed / task.total:.0f}%)" if finite else ""
    rate = f", {tokens / elapsed:,.0f} tok/s" if tokens and elapsed > 0 else ""
    note = f", {task.fields['note']}" if task.fields.get("note") else ""
    return (
        f"{task.description}: {task.completed:,.0f}{total}{pct}{rate}{note}, {_clock(elapsed)} elapsed, "
        f"ETA {_clock(eta_seconds(task))}"
    )


class _LoggedProgress(Progress):
    """A rich progress display that, on a console which is not a terminal (a log file, a pipe), where
    rich draws nothing until the end, prints :func:`progress_line` for every unfinished task every
    :data:`LOG_EVERY_S` seconds from a background thread while it is open."""

    def start(self) -> None:  # also what ``with`` calls: a stage may start and stop the display itself
        super().start()
        self._stop = threading.Event()
        self._thread = None
        if not self.console.is_terminal and not self.disable and LOG_EVERY_S > 0:
            self._thread = threading.Thread(target=self._log, daemon=True)
            self._thread.start()

    def _log(self) -> None:
        while not self._stop.wait(LOG_EVERY_S):
            for task in list(self.tasks):
                if not task.finished:
                    self.console.print(progress_line(task), markup=False, highlight=False)

    def stop(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        super().stop()


def progress(disable: bool = False) -> Progress:
    """A progress display: description, bar, done/total, tokens/s (task field ``tokens``), elapsed, ETA
    (``disable``: show nothing, for the non-main processes of a distributed run). Written to a log
    instead of a terminal, it also prints a line per unfinished task every 30 seconds
    (``EAGLE3KIT_PROGRESS_EVERY``) with done/total, rate and ETA, so a long stage is never silent."""
    return _LoggedProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _TokensPerSecond(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        disable=disable,
    )


def print_table(title: str, rows: list[tuple[str, object]]) -> None:
    """Print a two-column table of (name, value) to stdout."""
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in rows:
        if isinstance(v, float):
            v = f"{v:.4f}"
        t.add_row(k, str(v))
    Console().print(t)


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0


_PIECE_STYLE = {
    "content": "bold green",
    "reasoning": "bold cyan",
    "think_marker": "bold magenta",
    "end_of_turn": "bold yellow",
    "tool_calls": "bold blue",
    "template": "dim red",
}


#: control characters of the data (an ANSI escape sequence, a carriage return, a bell) written as
#: ``\x1b``-style text, so printing a sample never drives the terminal; newline and tab are kept
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)}


def visible(text: str) -> str:
    """``text`` with its control characters (C0 but newline and tab, DEL, C1) written as ``\\xNN``."""
    return text.translate(_CONTROLS)


def show_samples(tokenizer, samples) -> None:
    """Print samples for a person to look at: the prompt dim, supervised pieces coloured by kind
    (content green, reasoning cyan, think markers magenta, end-of-turn yellow, tool calls blue),
    unsupervised completion pieces (a template-inserted empty think block) dim red; special
    tokens shown as written, with ``⟦id⟧`` after each marker so look-alike text stands out.
    Without colour (a pipe, a file) supervised stretches are wrapped in ``«…»`` and unsupervised
    completion pieces in ``‹…›``. Control characters of the data are shown as ``\\xNN`` (:func:`visible`)."""
    out = Console(soft_wrap=True)
    plain = out.color_system is None
    for n, s in enumerate(samples):
        t = Text(
            f"── sample {n} (ends at message {s.turn}, {len(s.ids)} tokens, {sum(s.mask)} supervised, "
            f"{'returned ids' if s.returned_ids else 'rebuilt from text'}) ──\n",
            style="bold",
        )
        runs: list[tuple[str, str, bool]] = []  # (text, style, supervised)
        for tid, m in zip(s.ids[: s.prompt_len], s.mask[: s.prompt_len]):
            runs.append((visible(tokenizer.decode([tid])), "bold green" if m else "dim", bool(m)))
        for p in s.pieces:
            text = visible(tokenizer.decode(p.ids))
            if p.kind in ("think_marker", "end_of_turn", "template"):
                text += "⟦" + ",".join(map(str, p.ids)) + "⟧"
            runs.append((text, _PIECE_STYLE.get(p.kind, "") if p.supervised else "dim red", p.supervised))
        prev = False
        for i, (text, style, sup) in enumerate(runs):
            if plain and sup and not prev:
                t.append("«")
            if plain and not sup and i >= s.prompt_len and style == "dim red":
                text = "‹" + text + "›"
            t.append(text, style=style)
            if plain and sup and (i + 1 == len(runs) or not runs[i + 1][2]):
                t.append("»")
            prev = sup
        out.print(t)
    out.print(
        Text(
            "legend: prompt dim · content green · reasoning cyan · think markers magenta · end-of-turn yellow · "
            "tool calls blue · not supervised dim red"
            + (" · «supervised» ‹not supervised›" if plain else ""),
            style="italic",
        )
    )
