import json
import subprocess
import sys

import pytest

from vmmstream.cli import main


def test_info_runs_the_self_check_on_the_host_backend(capsys):
    assert main(["info", "--backend", "host", "--budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    for word in ("backend      host", "granularity", "budget       1.00 GiB", "pool self-check: ok"):
        assert word in out


def test_info_json(capsys):
    assert main(["info", "--backend", "host", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["selfcheck"]["ok"] and data["backend"] == "host" and data["granularity"] > 0
    assert data["budget"]["bytes"] > 0 and all(data["selfcheck"]["checks"].values())


def test_bad_environment_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "vmmstream.cli", "info"], capture_output=True, text=True,
                       env={"VMMSTREAM_LEGACY_ALLOCATOR": "sometimes", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    assert "VMMSTREAM_LEGACY_ALLOCATOR" in r.stderr and "sometimes" in r.stderr


def test_bad_budget_is_a_clear_error(capsys):
    assert main(["info", "--backend", "host", "--budget", "lots"]) == 2
    assert "budget 'lots'" in capsys.readouterr().err


def test_numba_plugin_contract_without_a_gpu():
    from vmmstream.numba_plugin import VmmstreamMemoryManager, _numba_memory_manager
    assert _numba_memory_manager is VmmstreamMemoryManager
    mm = VmmstreamMemoryManager(context=None)      # Numba builds one with context=None to check the version
    assert mm.interface_version == 1
    with pytest.raises(NotImplementedError):
        mm.get_ipc_handle(object())
