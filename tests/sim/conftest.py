"""Simulator tier: kernels run in the Numba CUDA simulator.

The simulator is chosen when numba is first imported, so NUMBA_ENABLE_CUDASIM=1 must be set in the
environment of the process. It is not set from here: doing so would switch every other tier collected
in the same process (the gpu tier included) to the simulator. Without it, every sim test fails loudly
rather than running on a real GPU or skipping. CI runs this tier as its own process:
NUMBA_ENABLE_CUDASIM=1 pytest -m sim tests/sim
"""

import sys

import pytest
from numba import config

from _barrier import install

if config.ENABLE_CUDASIM:
    install()      # a blocking barrier instead of the simulator's polling one (see _barrier.py)


@pytest.fixture(autouse=True)
def _require_simulator():
    if not config.ENABLE_CUDASIM:
        pytest.fail("the sim tier needs the Numba CUDA simulator, but numba was imported without it: "
                    "run it in its own process with NUMBA_ENABLE_CUDASIM=1, e.g. "
                    "`NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim tests/sim`", pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def _fast_thread_switching():
    """One Python thread per CUDA thread: short GIL hand-offs keep barrier-heavy kernels fast (a test may set
    its own interval, as the attention tests do per case)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(old)
