"""Console output: one progress bar style (rows, tokens/s, ETA) and summary tables, via rich."""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

console = Console(stderr=True)


class _TokensPerSecond(ProgressColumn):
    def render(self, task) -> Text:
        tokens = task.fields.get("tokens", 0)
        elapsed = task.elapsed or 0.0
        rate = tokens / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:,.0f} tok/s", style="cyan")


def progress() -> Progress:
    """A progress display: description, bar, done/total, tokens/s (task field ``tokens``), elapsed, ETA."""
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), _TokensPerSecond(),
        TextColumn("{task.fields[note]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=console, transient=False,
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
