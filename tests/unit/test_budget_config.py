import pytest

import vmmstream
from vmmstream import BudgetError, ConfigError, parse_budget
from vmmstream.config import BACKEND, BUDGET, LEGACY_ALLOCATOR

GiB = 2**30


@pytest.mark.parametrize("value,expected", [
    (123, 123),
    ("6GiB", 6 * GiB),
    ("512MB", 512 * 10**6),
    ("1.5 GB", 1_500_000_000),
    ("1.5GiB", int(1.5 * GiB)),
    ("2048", 2048),
    (" 4 gib ", 4 * GiB),
])
def test_sizes(value, expected):
    assert parse_budget(value) == expected


@pytest.mark.parametrize("value,expected", [(0.8, 80), ("80%", 80), ("0.5", 50), (1.0, 100), ("12.5%", 12.5)])
def test_fractions_of_device_total(value, expected):
    assert parse_budget(value, device_total=1000) == int(expected * 10)


def test_fraction_without_total_is_an_error():
    with pytest.raises(BudgetError, match="device total is unknown"):
        parse_budget("80%")
    with pytest.raises(BudgetError):
        parse_budget(0.5)


def test_auto_is_ninety_percent_of_free():
    assert parse_budget("auto", 1000, device_free=500) == 450
    with pytest.raises(BudgetError, match="free memory"):
        parse_budget("auto", 1000)


@pytest.mark.parametrize("bad", ["", "six GiB", "6 parsecs", "-1GiB", "0", 0, -5, "150%", 1.5, "0%", None, True,
                                 [1], "nan", float("inf")])
def test_bad_budgets_raise_budget_error(bad):
    with pytest.raises(BudgetError):
        parse_budget(bad, device_total=1000, device_free=1000)


def test_budget_error_is_a_value_error_and_importable():
    assert issubclass(vmmstream.BudgetError, ValueError)
    assert issubclass(vmmstream.CapacityError, MemoryError)
    for name in ("VmmstreamError", "CapacityError", "BudgetError", "DriverError", "CaptureError",
                 "WorkspaceShortfall"):
        assert issubclass(getattr(vmmstream, name), vmmstream.VmmstreamError)


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("YES", True), ("on", True),
                                          ("0", False), ("false", False), ("No", False), ("off", False)])
def test_legacy_allocator_values(raw, expected):
    assert LEGACY_ALLOCATOR.get({"VMMSTREAM_LEGACY_ALLOCATOR": raw}) is expected


@pytest.mark.parametrize("raw", ["2", "maybe", "tru", "enabled"])
def test_legacy_allocator_bad_value_names_variable_and_value(raw):
    with pytest.raises(ConfigError) as e:
        LEGACY_ALLOCATOR.get({"VMMSTREAM_LEGACY_ALLOCATOR": raw})
    assert "VMMSTREAM_LEGACY_ALLOCATOR" in str(e.value) and raw in str(e.value)


def test_unset_variables_take_defaults():
    assert LEGACY_ALLOCATOR.get({}) is False
    assert BACKEND.get({}) == "auto"
    assert BUDGET.get({}) is None


def test_backend_and_budget_are_validated():
    assert BACKEND.get({"VMMSTREAM_BACKEND": "HOST"}) == "host"
    with pytest.raises(ConfigError, match="VMMSTREAM_BACKEND"):
        BACKEND.get({"VMMSTREAM_BACKEND": "opencl"})
    assert BUDGET.get({"VMMSTREAM_BUDGET": "6GiB"}) == "6GiB"
    with pytest.raises(ConfigError, match="VMMSTREAM_BUDGET"):
        BUDGET.get({"VMMSTREAM_BUDGET": "lots"})


def _in_a_fresh_interpreter(module: str, attr: str):
    """``module.attr`` as a fresh interpreter sees it under this environment (read once, at import)."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.{attr})"], capture_output=True,
                       text=True, env=dict(os.environ))
    if r.returncode:
        raise ValueError(r.stderr.strip().splitlines()[-1])
    return {"True": True, "False": False}[r.stdout.strip()]


def _cublaslt():
    from vmmstream.kernels.matmul.dense import gemm
    return gemm._prefer_cublaslt()


def _cudnn():
    from vmmstream.kernels.attention import prefill
    return prefill._prefer_cudnn()


def _cudnn_buckets():
    return _in_a_fresh_interpreter("vmmstream.kernels.attention.cudnn_sdpa", "PADDED")


SWITCHES = {"VMMSTREAM_CUBLASLT": (True, _cublaslt), "VMMSTREAM_CUDNN": (False, _cudnn),
            "VMMSTREAM_CUDNN_BUCKETS": (False, _cudnn_buckets)}


@pytest.mark.parametrize("name", list(SWITCHES))
@pytest.mark.parametrize("raw", [None, "", "1", "ON", "yes", "0", "off", "No"])
def test_kernel_switches_take_only_known_words(monkeypatch, name, raw):
    """cuBLASLt is on unless switched off; cuDNN's attention and its length buckets are opt-in. The kernels and
    ``vmmstream.config`` (``vmmstream env``) read each switch the same way, and a typo is an error."""
    from vmmstream import config
    default, read = SWITCHES[name]
    expected = default if raw is None or not raw.strip() else raw.strip().lower() in ("1", "on", "yes")
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    assert read() is expected
    var = next(v for v in config.ALL if v.name == name)
    assert var.get({} if raw is None else {name: raw}) is expected
    if raw and name != "VMMSTREAM_CUDNN_BUCKETS":          # (one fresh interpreter for the typo is enough)
        monkeypatch.setenv(name, raw[:-1] + "x")
        with pytest.raises(ValueError, match=name):
            read()


def test_a_cudnn_buckets_typo_is_an_error_not_a_silent_switch(monkeypatch):
    monkeypatch.setenv("VMMSTREAM_CUDNN_BUCKETS", "onn")
    with pytest.raises(ValueError, match="VMMSTREAM_CUDNN_BUCKETS"):
        _cudnn_buckets()
