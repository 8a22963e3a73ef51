"""``bench/serve_load.py`` against a real ``vmmstream serve`` on the host backend: a smoke run of the load
generator (a tiny preset without tokenizer, so token-id prompts and empty texts, 1 and 8 clients)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import serve_load

import vmmstream
from vmmstream.model import make_checkpoint

pytestmark = pytest.mark.unit


def test_serve_load_smoke_on_the_host_backend(tmp_path, capsys):
    from vmmstream.server.runner import make_server
    path = make_checkpoint("tiny", tmp_path / "tiny", seed=0)
    with vmmstream.load_model(path, "64MiB", backend="host", max_context=64) as model:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = make_server(model, log_level="error", max_queue=16)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            while not server.started:
                assert thread.is_alive()
                time.sleep(0.005)
            rows = serve_load.run(url, clients=(1, 8), requests=2, max_tokens=8, prompt=[3, 4, 5, 6])
            assert serve_load.main(["--url", url, "--clients", "2", "--requests", "1", "--max-tokens", "4",
                                    "--prompt-tokens", "4", "--json", str(tmp_path / "rows.json")]) == 0
        finally:
            server.should_exit = True
            thread.join(10)
            server.close()
    for row, clients in zip(rows, (1, 8)):
        assert row["clients"] == clients and row["completed"] == 2 * clients and row["refused"] == row["failed"] == 0
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and row["requests_per_s"] > 0
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and row["itl_p50_s"] <= row["itl_p99_s"]
    assert "TTFT p50" in capsys.readouterr().out
    assert json.loads((tmp_path / "rows.json").read_text())["rows"][0]["completed"] == 2
