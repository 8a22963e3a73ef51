"""The ``vmmstream`` command never answers a user error or a Ctrl-C with a traceback: bad arguments are argparse
errors at parse time (exit 2), errors found later are one ``vmmstream: error:`` line (exit 2), an interrupt is
``vmmstream: interrupted`` (exit 130) with the device memory released. Runs ``main`` in-process on the host
backend."""

from __future__ import annotations

import pytest

from vmmstream import memory as memmod
from vmmstream.api import Model
from vmmstream.cli import main
from vmmstream.loading import Placement
from vmmstream.model import make_checkpoint

GEN = ["--budget", "64MiB", "--max-context", "64", "--backend", "host", "--max-new-tokens", "4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=1)


def run(argv) -> int:
    """``main(argv)``'s exit code, whether returned or raised as SystemExit (argparse). A KeyboardInterrupt that
    escapes is a failure here, not the end of the pytest session."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped vmmstream.cli.main")


def open_memories() -> set:
    return {id(m) for m in memmod._by_device.values() if not m.closed}


@pytest.mark.parametrize("option, value, accepted", [
    ("--ids", "-1", "non-negative"),
    ("--ids", "1.5", "non-negative"),
    ("--ids", "", "non-negative"),
    ("--slots", "1", ">= 2"),
    ("--temperature", "nan", "finite"),
    ("--temperature", "-0.5", ">= 0"),
    ("--top-p", "0", "(0, 1]"),
    ("--top-p", "1.5", "(0, 1]"),
    ("--top-k", "-1", ">= 0"),
    ("--max-new-tokens", "0", ">= 1"),
    ("--budget", "lots", "examples: 6GiB"),          # the package's own budget message
])
def test_bad_generate_argument_is_an_argparse_error(tiny, capsys, option, value, accepted):
    argv = ["generate", str(tiny), *GEN, *([] if option == "--ids" else ["--ids", "1"]), option, value]
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert f"vmmstream generate: error: argument {option}: " in err and repr(value) in err and accepted in err
    assert "Traceback" not in err


def test_ids_outside_the_vocabulary_is_one_line(tiny, capsys):
    assert run(["generate", str(tiny), *GEN, "--ids", "1,999"]) == 2
    err = capsys.readouterr().err                    # known only once the checkpoint is open: the API's ValueError
    assert err.startswith("vmmstream: error: ") and err.count("\n") == 1
    assert "999" in err and "vocabulary" in err


def test_unwritable_checkpoint_target_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "ck"                 # under a file: fails even for root, unlike a 0o555 directory
    assert run(["make-checkpoint", "--preset", "tiny", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vmmstream: error: ") and str(target) in err and err.count("\n") == 1
    assert "Traceback" not in err


def test_ctrl_c_during_generate_closes_the_model(tiny, capsys, monkeypatch):
    seen = []

    def interrupted(self, *args, **kwargs):
        seen.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(Model, "generate", interrupted)
    before = open_memories()
    assert run(["generate", str(tiny), *GEN, "--ids", "1,2"]) == 130
    assert capsys.readouterr().err == "vmmstream: interrupted\n"
    (model,) = seen
    mem = model.memory
    assert model.closed and not mem.blocks and mem.mapped_bytes == 0
    assert not any(lease.holder == model.holder for lease in mem.authority.leases.values())
    assert open_memories() == before                  # the memory the CLI's load made is closed again


def test_ctrl_c_while_loading_releases_what_was_placed(tiny, capsys, monkeypatch):
    seen = []
    place = Placement.place

    def interrupted(self, *args, **kwargs):
        place(self, *args, **kwargs)                  # the weights are on the device when the interrupt comes
        seen.append(self.memory)
        raise KeyboardInterrupt

    monkeypatch.setattr(Placement, "place", interrupted)
    before = open_memories()
    assert run(["generate", str(tiny), *GEN, "--ids", "1,2"]) == 130
    assert capsys.readouterr().err == "vmmstream: interrupted\n"
    (mem,) = seen
    assert not mem.blocks and mem.mapped_bytes == 0 and not mem.driver.host_allocs
    assert open_memories() == before


def test_an_internal_bug_still_shows_its_traceback(tiny, monkeypatch):
    def bug(self, *args, **kwargs):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(Model, "generate", bug)
    with pytest.raises(RuntimeError, match="an internal bug"):
        main(["generate", str(tiny), *GEN, "--ids", "1"])
