"""Load progress for a person: a bar on a terminal, plain lines (no carriage returns) in a pipe or a log."""

from __future__ import annotations

import io

import pytest

import vmmstream
from vmmstream.progress import ByteProgress

pytestmark = pytest.mark.unit


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_a_line_at_each_tenth_and_no_carriage_returns():
    out = io.StringIO()
    p = ByteProgress(1000, "loading weights", file=out)
    for done in range(0, 1001, 7):
        p(done, 1000)
    p(1000, 1000, final=True)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert 10 <= len(lines) <= 11 and lines[-1].endswith("(100%)")
    assert all(ln.startswith("loading weights: ") for ln in lines)


def test_a_terminal_gets_one_bar_redrawn_in_place():
    out = Terminal()
    p = ByteProgress(1 << 30, "loading weights", file=out)
    for k in range(1, 9):
        p(k << 27, 1 << 30)
    p(1 << 30, 1 << 30, final=True)
    p(1 << 30, 1 << 30, final=True)              # after the end: nothing more
    text = out.getvalue()
    assert "\r" in text and "loading weights" in text and "100%" in text
    assert text.count("\n") <= 1


def test_load_model_progress_in_a_pipe_is_plain_lines(tmp_path, capsys):
    from vmmstream.model import make_checkpoint
    path = make_checkpoint("tiny", tmp_path / "tiny", seed=0)
    with vmmstream.load_model(path, budget="64MiB", backend="host", max_context=64, progress=True):
        pass
    err = capsys.readouterr().err
    assert "\r" not in err and "loading weights:" in err and err.strip().splitlines()[-1].endswith("(100%)")
