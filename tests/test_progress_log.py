"""Written to a log (a console that is not a terminal), a long stage is never silent: every unfinished
progress task prints a line with done/total, tokens/s, elapsed and ETA every ``LOG_EVERY_S`` seconds,
and a terminal gets rich's bar only."""

import io
import time

from rich.console import Console

from eagle3kit.core import ui


def _run(monkeypatch, terminal: bool) -> str:
    buf = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=buf, force_terminal=terminal, width=160))
    monkeypatch.setattr(ui, "LOG_EVERY_S", 0.2)
    with ui.progress() as bar:
        t = bar.add_task("generate (vllm)", total=8, tokens=0, note="")
        for i in range(8):
            time.sleep(0.1)
            bar.update(t, advance=1, tokens=50 * (i + 1))
    return buf.getvalue()


def test_a_log_gets_a_progress_line_every_interval(monkeypatch):
    out = _run(monkeypatch, terminal=False)
    lines = [ln for ln in out.splitlines() if ln.startswith("generate (vllm): ")]
    assert 2 <= len(lines) <= 0.8 / 0.2 + 2, out  # 0.8 s of work at one line per 0.2 s, not one per update
    done = [int(ln.split(": ")[1].split("/")[0]) for ln in lines]
    assert done == sorted(done) and all(ln.split("/")[1].startswith("8 (") for ln in lines)
    assert all("tok/s" in ln and "elapsed, ETA " in ln for ln in lines), lines


def test_a_display_started_and_stopped_by_hand_logs_too(monkeypatch):
    """A stage may call ``bar.start()`` and ``bar.stop()`` itself (Magpie does) instead of ``with``."""
    buf = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=buf, force_terminal=False, width=160))
    monkeypatch.setattr(ui, "LOG_EVERY_S", 0.1)
    bar = ui.progress()
    bar.start()
    t = bar.add_task("synthesize prompts (Magpie)", total=4, tokens=0, note="")
    for _ in range(4):
        time.sleep(0.1)
        bar.update(t, advance=1)
    bar.stop()
    assert buf.getvalue().count("synthesize prompts (Magpie): ") >= 2, buf.getvalue()


def test_a_terminal_gets_no_log_lines(monkeypatch):
    assert "generate (vllm): " not in _run(monkeypatch, terminal=True)


def test_the_line_reads_like_a_person_would_write_it():
    from rich.progress import Progress

    p = Progress()
    t = p.add_task("train epoch 3/20", total=40, tokens=0, note="loss 9.1")
    p.update(t, completed=10, tokens=12000)
    line = ui.progress_line(p.tasks[0])
    assert line.startswith("train epoch 3/20: 10/40 (25%), ") and ", loss 9.1, " in line and "ETA " in line


def test_a_stage_that_advances_in_large_batches_still_gets_an_eta():
    """rich estimates speed from the last 30 s of steps; generation advances 128 rows at a time, a
    minute apart, and its log lines read "ETA ?" between batches. The line falls back to the rate since
    the start: 1,280 of 1,500 rows in 480 s leave 220 rows, 82.5 s."""
    from rich.progress import Progress

    clock = [0.0]
    p = Progress(get_time=lambda: clock[0])
    t = p.add_task("generate (vllm)", total=1500, tokens=0, note="")
    p.start_task(t)
    clock[0] = 450.0
    p.update(t, completed=1280, tokens=250_000)
    clock[0] = 480.0 + p.speed_estimate_period  # no step within rich's window
    task = p.tasks[0]
    assert task.time_remaining is None
    secs = ui.eta_seconds(task)
    assert abs(secs - 220 * task.elapsed / 1280) < 1e-9
    assert ui.progress_line(task).endswith(f"ETA {ui._clock(secs)}") and "ETA ?" not in ui.progress_line(task)
    fresh = p.add_task("tokenize", total=10)
    assert ui.eta_seconds(p.tasks[fresh]) is None  # before its first step: no rate to go by


def test_the_eta_is_never_negative_and_unknown_reads_as_a_question_mark():
    from rich.progress import Progress

    clock = [0.0]
    p = Progress(get_time=lambda: clock[0])
    over = p.add_task("over", total=100)
    p.start_task(over)
    clock[0] = 10.0
    p.update(over, completed=150)  # more done than the total: rich's own estimate is negative
    back = p.add_task("back", total=float("nan"))
    p.start_task(back)
    p.update(back, completed=3)
    clock[0] = 20.0
    assert ui.eta_seconds(p.tasks[over]) == 0.0
    assert ui.eta_seconds(p.tasks[back]) is None and "nan" not in ui.progress_line(p.tasks[back])
    assert [ui._clock(v) for v in (-5.0, float("inf"), 100 * 3600.0, 59.0)] == ["?", "?", "?", "0:00:59"]
