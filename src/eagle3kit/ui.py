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


_PIECE_STYLE = {"content": "bold green", "reasoning": "bold cyan", "think_marker": "bold magenta",
                "end_of_turn": "bold yellow", "tool_calls": "bold blue", "template": "dim red"}


def show_samples(tokenizer, samples) -> None:
    """Print samples for a person to look at: the prompt dim, supervised pieces coloured by kind
    (content green, reasoning cyan, think markers magenta, end-of-turn yellow, tool calls blue),
    unsupervised completion pieces (a template-inserted empty think block) dim red; special
    tokens shown as written, with ``⟦id⟧`` after each marker so look-alike text stands out."""
    out = Console()
    for n, s in enumerate(samples):
        t = Text(f"── sample {n} (turn {s.turn}, {len(s.ids)} tokens, {sum(s.mask)} supervised, "
                 f"{'returned ids' if s.returned_ids else 'rebuilt from text'}) ──\n", style="bold")
        prompt = s.ids[:s.prompt_len]
        for tid, m in zip(prompt, s.mask[:s.prompt_len]):
            t.append(tokenizer.decode([tid]), style="bold green" if m else "dim")
        for p in s.pieces:
            style = _PIECE_STYLE.get(p.kind, "") if p.supervised else "dim red"
            text = tokenizer.decode(p.ids)
            if p.kind in ("think_marker", "end_of_turn", "template"):
                text += "⟦" + ",".join(map(str, p.ids)) + "⟧"
            t.append(text, style=style)
        out.print(t)
        out.print(Text("legend: prompt dim · content green · reasoning cyan · think markers magenta · end-of-turn yellow · "
                       "tool calls blue · not supervised dim red", style="italic") if n == len(samples) - 1 else "")
