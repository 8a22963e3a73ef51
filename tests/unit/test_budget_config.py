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


@pytest.mark.parametrize("raw,expected", [(None, True), ("", True), ("1", True), ("ON", True), ("0", False),
                                          ("off", False), ("no", False)])
def test_cublaslt_is_the_default_and_only_known_words_switch_it(monkeypatch, raw, expected):
    from vmmstream.config import CUBLASLT
    from vmmstream.kernels.matmul.dense import gemm
    if raw is None:
        monkeypatch.delenv("VMMSTREAM_CUBLASLT", raising=False)
    else:
        monkeypatch.setenv("VMMSTREAM_CUBLASLT", raw)
    assert gemm._prefer_cublaslt() is expected
    assert CUBLASLT.get({} if raw is None else {"VMMSTREAM_CUBLASLT": raw}) is expected


@pytest.mark.parametrize("raw,expected", [(None, False), ("", False), ("yes", True), ("1", True), ("0", False),
                                          ("OFF", False)])
def test_cudnn_attention_is_opt_in_and_only_known_words_switch_it(monkeypatch, raw, expected):
    from vmmstream.config import CUDNN
    from vmmstream.kernels.attention import prefill
    if raw is None:
        monkeypatch.delenv("VMMSTREAM_CUDNN", raising=False)
    else:
        monkeypatch.setenv("VMMSTREAM_CUDNN", raw)
    assert prefill._prefer_cudnn() is expected
    assert CUDNN.get({} if raw is None else {"VMMSTREAM_CUDNN": raw}) is expected
    if raw is not None and raw.strip():
        monkeypatch.setenv("VMMSTREAM_CUDNN", raw[:-1] + "x")      # a typo is an error, not a silent switch
        with pytest.raises(ValueError, match="VMMSTREAM_CUDNN"):
            prefill._prefer_cudnn()


@pytest.mark.parametrize("raw", ["of", "disable"])
def test_cublaslt_typo_is_an_error_not_a_silent_switch(monkeypatch, raw):
    from vmmstream.kernels.matmul.dense import gemm
    monkeypatch.setenv("VMMSTREAM_CUBLASLT", raw)
    with pytest.raises(ValueError, match="VMMSTREAM_CUBLASLT"):
        gemm._prefer_cublaslt()
