"""The on-disk kernel cache's keys, folder and switches (``vmmstream/kernels/base/jit.py``); that a second process
loads instead of compiling is checked on the GPU (``tests/gpu/test_load_model_gpu.py``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from test_kernel_compile import KERNEL_MODULES, _import
from vmmstream.errors import ConfigError
from vmmstream.kernels.base import jit as J

pytestmark = pytest.mark.unit


def _factory(vec, flag, table=None):
    def k(x):
        if flag:
            x[0] = vec
        if table is not None:
            x[1] = table[0]
    return k


def test_closure_key_is_stable_and_follows_every_closed_over_value():
    a = J.closure_key(_factory(8, True))
    assert a == J.closure_key(_factory(8, True))          # a new closure over equal values: the same entry
    assert a != J.closure_key(_factory(4, True))
    assert a != J.closure_key(_factory(8, False))
    assert a != J.closure_key(_factory(8, 1))              # True and 1 compile differently (bool vs int64)
    t = np.arange(4, dtype=np.int32)
    assert J.closure_key(_factory(8, True, t)) == J.closure_key(_factory(8, True, t.copy()))
    t2 = t.copy()
    t2[3] = 7
    assert J.closure_key(_factory(8, True, t)) != J.closure_key(_factory(8, True, t2))
    assert J.closure_key(_factory(8, True, t)) != J.closure_key(_factory(8, True, t.astype(np.int64)))


def test_a_closed_over_function_is_fingerprinted_by_what_it_closes_over():
    def outer(v):
        def helper():
            return v
        return _factory(helper, True)
    assert J.closure_key(outer(1)) == J.closure_key(outer(1))
    assert J.closure_key(outer(1)) != J.closure_key(outer(2))


def test_a_value_without_a_stable_description_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("VMMSTREAM_CACHE_DIR", str(tmp_path))
    with pytest.raises(J.Uncachable):
        J.closure_key(_factory(object(), True))
    d = J.jit(_factory(object(), True))
    assert not J.cached(d)                                   # compiled per process, as without the cache
    d = J.jit(_factory(3, True))
    assert J.cached(d)
    assert not (tmp_path / "kernels").exists()               # nothing is written before a kernel is compiled


def test_compile_options_and_code_are_part_of_the_key():
    fn = _factory(8, True)
    assert J.closure_key(fn, {"launch_bounds": (128, 1)}) != J.closure_key(fn, {"launch_bounds": (128, 3)})
    assert J.closure_key(fn, {"launch_bounds": (128, 1)}) == J.closure_key(_factory(8, True), {"launch_bounds": (128, 1)})

    def other(vec, flag, table=None):      # same closure values, other code
        def k(x):
            if flag:
                x[0] = vec + 1
        return k
    assert J.closure_key(other(8, True)) != J.closure_key(fn)
    from vmmstream.kernels.attention import decode
    a, b = decode._make_split(4, 128, MINB=1), decode._make_split(4, 128, MINB=3)
    assert a._cache._closure != b._cache._closure            # launch bounds (128, 1) vs (128, 3)


def test_entries_are_files_named_by_their_whole_key(tmp_path):
    f = J._KeyedFiles(str(tmp_path), "k-12.py311", "tag1")
    f.save(("sigA", 1), {"cubin": b"A"})
    f.save(("sigB", 1), {"cubin": b"B"})
    assert f.load(("sigA", 1)) == {"cubin": b"A"} and f.load(("sigB", 1)) == {"cubin": b"B"}
    assert f.load(("sigC", 1)) is None
    assert len(list(tmp_path.iterdir())) == 2                # no index, no temporary file left
    assert J._KeyedFiles(str(tmp_path), "k-12.py311", "tag2").load(("sigA", 1)) is None   # another build
    a = f._name(("sigA", 1))
    import os
    os.replace(f._name(("sigB", 1)), a)                      # a file holding another key's entry is not used
    assert f.load(("sigA", 1)) is None


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_every_kernel_a_model_launches_can_be_cached(name):
    for pyfunc, _ in _import(name).SIGNATURES:
        fn = getattr(pyfunc, "py_func", pyfunc)
        assert J.closure_key(fn) == J.closure_key(fn), fn.__qualname__


def test_the_tag_covers_every_kernel_source_and_the_toolchain(tmp_path, monkeypatch):
    files = J.kernel_sources()
    names = {p.name for p in files}
    assert {"jit.py", "launch.py", "gemv.py", "decode.py", "experts.py", "norm.py"} <= names
    top = tmp_path / "kernels"
    (top / "base").mkdir(parents=True)
    (top / "base" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(J, "kernel_sources", lambda: sorted(top.rglob("*.py")))
    monkeypatch.setattr(J, "__file__", str(top / "base" / "jit.py"))
    t1 = J.source_tag.__wrapped__()
    (top / "base" / "a.py").write_text("x = 2\n")
    t2 = J.source_tag.__wrapped__()
    (top / "b.py").write_text("")
    t3 = J.source_tag.__wrapped__()
    assert len({t1, t2, t3}) == 3
    import numba_cuda
    monkeypatch.setattr(numba_cuda, "__version__", "0.0.0")
    assert J.source_tag.__wrapped__() != t3


def test_folder_and_switch(tmp_path, monkeypatch):
    monkeypatch.delenv("VMMSTREAM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert J.cache_root() == tmp_path / "xdg" / "vmmstream"
    monkeypatch.setenv("VMMSTREAM_CACHE_DIR", str(tmp_path / "mine"))
    assert J.cache_dir() == tmp_path / "mine" / "kernels" / J.source_tag()
    for v in ("0", "off", "False"):
        monkeypatch.setenv("VMMSTREAM_KERNEL_CACHE", v)
        assert not J.enabled()
        assert not J.cached(J.jit(_factory(3, True)))
    monkeypatch.setenv("VMMSTREAM_KERNEL_CACHE", "1")
    assert J.enabled()
    monkeypatch.setenv("VMMSTREAM_KERNEL_CACHE", "sometimes")
    with pytest.raises(ConfigError, match="VMMSTREAM_KERNEL_CACHE"):
        J.enabled()


def test_cli_reports_and_clears_the_cache(tmp_path, monkeypatch, capsys):
    from vmmstream.cli import main
    monkeypatch.setenv("VMMSTREAM_CACHE_DIR", str(tmp_path))
    build = tmp_path / "kernels" / J.source_tag()
    build.mkdir(parents=True)
    (build / "k.nbc").write_bytes(b"x" * 1000)
    (tmp_path / "kernels" / "0123456789abcdef").mkdir()
    assert main(["cache", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["files"] == 1 and out["bytes"] == 1000 and out["this_build"] == str(build)
    assert sorted(out["builds"]) == sorted(["0123456789abcdef", J.source_tag()])
    assert main(["cache"]) == 0
    assert "1 files" in capsys.readouterr().out
    assert main(["cache", "--clear"]) == 0
    assert "1000 B" in capsys.readouterr().out or "1000" in capsys.readouterr().out
    assert not (tmp_path / "kernels").exists()
