"""``vmmstream serve``: an OpenAI-compatible HTTP server over one loaded model (needs the ``serve`` extra:
``pip install 'vmmstream[serve]'``).

``app`` translates HTTP (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``); ``schemas`` checks requests and builds responses; ``scheduler`` owns the engine on one worker
thread with a bounded admission queue (429 with Retry-After before any response byte); ``engine`` is the
interface an engine offers the scheduler and today's batch-size-1 implementation of it; ``metrics`` the
Prometheus registry; ``runner`` wires them to uvicorn.
"""

from __future__ import annotations

REQUIRES = ("fastapi", "uvicorn", "prometheus_client")
INSTALL_HINT = "pip install 'vmmstream[serve]'  (fastapi, uvicorn, prometheus-client)"


def missing() -> list[str]:
    """The serve extra's modules that do not import here."""
    import importlib
    out = []
    for name in REQUIRES:
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out
