"""The cuDNN prefill-attention route's host side, against a stand-in for the ``cudnn`` frontend module: how our
[T, H, D] q and [S, Hkv, D] cache are described to cuDNN (dims, strides, the bottom-right causal diagonal), one graph
per shape kept and reused, nothing built during a capture, a shape cuDNN refuses remembered, the workspace bound.
Its numbers are checked on the GPU (``tests/gpu/test_attention_gpu.py -k cudnn``)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from vmmstream.kernels.attention import cudnn_sdpa, prefill as ap
from vmmstream.kernels.base.launch import data_ptr


class _T:
    def __init__(self, **kw):
        self.kw = kw

    def set_output(self, v):
        self.kw["output"] = v
        return self

    def set_dim(self, d):
        self.kw["dim"] = d
        return self

    def set_stride(self, s):
        self.kw["stride"] = s
        return self

    def set_data_type(self, t):
        self.kw["data_type"] = t
        return self


class FakeCudnn:
    """Records every graph built and every execute; ``fail`` makes ``build`` raise, ``ws`` is the workspace asked."""

    def __init__(self):
        self.graphs, self.runs, self.streams, self.fail, self.ws = [], [], [], False, 256
        self.fail_padded = False        # build refuses graphs with the padding mask only
        self.data_type = types.SimpleNamespace(BFLOAT16="bf16", FLOAT="f32", INT32="i32")
        self.diagonal_alignment = types.SimpleNamespace(BOTTOM_RIGHT="bottom_right", TOP_LEFT="top_left")
        self.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
        fake = self

        class Graph:
            def __init__(self, **kw):
                self.kw, self.tensors = kw, {}
                fake.graphs.append(self)

            def tensor(self, **kw):
                t = self.tensors[kw["name"]] = _T(**kw)
                return t

            def sdpa(self, **kw):
                self.sdpa_kw = kw
                self.tensors["o"] = _T(name="o")
                return self.tensors["o"], None

            def build(self, modes):
                if fake.fail_padded and self.sdpa_kw.get("use_padding_mask"):
                    raise RuntimeError("cudnnGraphNotSupportedError: no padding mask with this diagonal")
                if fake.fail:
                    raise RuntimeError("cudnnGraphNotSupportedError: no engine")

            def get_workspace_size(self):
                return fake.ws

            def execute(self, pack, ws, handle):
                fake.runs.append((self, {t.kw["name"]: p for t, p in pack.items()}, ws, handle))

        self.pygraph = Graph

    def set_stream(self, handle, stream):
        self.streams.append((handle, stream))


@pytest.fixture
def fake(monkeypatch):
    f = FakeCudnn()
    monkeypatch.setattr(cudnn_sdpa, "_state", {"lib": f, "handle": "H", "graphs": {}})
    capturing = {"on": False}
    monkeypatch.setattr(cudnn_sdpa, "_capturing", lambda handle: capturing["on"])
    f.capturing = capturing
    return f


def arrays(T, hq, hkv, d, S):
    q = np.zeros((T, hq, d), np.uint16)
    k, v = np.zeros((S, hkv, d), np.uint16), np.zeros((S, hkv, d), np.uint16)
    return q, k, v, np.zeros_like(q), np.zeros(cudnn_sdpa.WORKSPACE, np.uint8)


class _Stream:
    handle = types.SimpleNamespace(value=0x5000)


def test_our_layout_described_by_strides_with_the_bottom_right_diagonal(fake):
    T, hq, hkv, d, S, start, layers, layer = 40, 8, 2, 64, 100, 25, 3, 1
    q, _, _, out, ws = arrays(T, hq, hkv, d, S)
    cache = np.zeros((S, layers, 2, hkv, d), np.uint16)      # a model's cache: position-major over every layer
    k, v = cache[:, layer, 0], cache[:, layer, 1]
    row = layers * 2 * hkv * d                               # a layer's K rows are a whole position's row apart
    cudnn_sdpa.launch(q, k, v, out, ws, start_pos=start, scale=0.125, stream=_Stream())
    (g,) = fake.graphs
    t = g.tensors
    assert t["q"].kw["dim"] == [1, hq, T, d] and t["q"].kw["stride"] == [T * hq * d, d, hq * d, 1]
    for name in ("k", "v"):      # the cache's first start + T rows, at the cache's own row stride
        assert t[name].kw["dim"] == [1, hkv, start + T, d]
        assert t[name].kw["stride"] == [(start + T) * row, d, row, 1]
    assert t["o"].kw["dim"] == [1, hq, T, d] and t["o"].kw["stride"] == [T * hq * d, d, hq * d, 1]
    assert t["o"].kw["output"] is True and t["o"].kw["data_type"] == "bf16"
    kw = g.sdpa_kw
    assert kw["diagonal_alignment"] == "bottom_right" and kw["diagonal_band_right_bound"] == 0
    assert kw["attn_scale"] == 0.125 and kw["generate_stats"] is False
    (run,) = fake.runs
    assert run[1] == {"q": data_ptr(q), "k": data_ptr(k), "v": data_ptr(v), "o": data_ptr(out)}
    assert run[2] == data_ptr(ws) and run[3] == "H" and fake.streams == [("H", 0x5000)]
    cudnn_sdpa.launch(q, cache[:, 2, 0], cache[:, 2, 1], out, ws, start_pos=start, scale=0.125, stream=None)
    assert len(fake.graphs) == 1          # another layer: the same strides, the same graph
    contiguous = np.zeros((S, hkv, d), np.uint16)
    cudnn_sdpa.launch(q, contiguous, contiguous, out, ws, start_pos=start, scale=0.125, stream=None)
    assert len(fake.graphs) == 2 and fake.graphs[1].tensors["k"].kw["stride"][2] == hkv * d
    with pytest.raises(cudnn_sdpa.Unsupported, match="packed"):       # D not packed: refused, nothing built
        kt = np.zeros((S, d, hkv), np.uint16).transpose(0, 2, 1)
        cudnn_sdpa.launch(q, kt, kt, out, ws, start_pos=0, scale=0.1, stream=None)
    assert len(fake.graphs) == 2


def test_one_graph_per_shape_reused(fake):
    q, k, v, out, ws = arrays(16, 4, 1, 64, 64)
    for _ in range(3):
        cudnn_sdpa.launch(q, k, v, out, ws, start_pos=0, scale=0.1, stream=None)
    assert len(fake.graphs) == 1 and len(fake.runs) == 3
    cudnn_sdpa.launch(q, k, v, out, ws, start_pos=8, scale=0.1, stream=None)    # more keys: another graph
    cudnn_sdpa.launch(q, k, v, out, ws, start_pos=0, scale=0.2, stream=None)    # another scale: another graph
    assert len(fake.graphs) == 3 and len(fake.runs) == 5


def test_nothing_is_built_during_a_capture(fake):
    q, k, v, out, ws = arrays(16, 4, 1, 64, 64)
    fake.capturing["on"] = True
    with pytest.raises(cudnn_sdpa.Unsupported, match="capture"):
        cudnn_sdpa.launch(q, k, v, out, ws, start_pos=0, scale=0.1, stream=None)
    assert fake.graphs == [] and fake.runs == [] and cudnn_sdpa._state["graphs"] == {}
    fake.capturing["on"] = False
    cudnn_sdpa.launch(q, k, v, out, ws, start_pos=0, scale=0.1, stream=None)    # eager: built
    fake.capturing["on"] = True
    cudnn_sdpa.launch(q, k, v, out, ws, start_pos=0, scale=0.1, stream=None)    # captured: the kept graph
    assert len(fake.graphs) == 1 and len(fake.runs) == 2


def test_a_refused_shape_is_remembered_and_raises_before_any_work(fake):
    q, k, v, out, ws = arrays(16, 4, 1, 64, 64)
    fake.fail = True
    for _ in range(2):
        with pytest.raises(cudnn_sdpa.Unsupported, match="no engine"):
            cudnn_sdpa.launch(q, k, v, out, ws, start_pos=0, scale=0.1, stream=None)
    assert len(fake.graphs) == 1 and fake.runs == []      # built once, refused, not tried again
    fake.fail, fake.ws = False, cudnn_sdpa.WORKSPACE + 1    # a plan wanting more than the planned workspace
    with pytest.raises(cudnn_sdpa.Unsupported, match="workspace"):
        cudnn_sdpa.launch(q, k, v, out, ws, start_pos=1, scale=0.1, stream=None)
    assert fake.runs == []
    with pytest.raises(ValueError, match="workspace"):      # a short view: the caller's error, not a fallback
        cudnn_sdpa.launch(q, k, v, out, ws[:-1], start_pos=0, scale=0.1, stream=None)


def test_padded_graphs_serve_every_length_of_their_bucket(fake, monkeypatch):
    """With ``PADDED``: one graph per (bucket of T, bucket of keys), built with cuDNN's padding mask; each call writes
    its real lengths into the workspace's last bytes on the stream and passes them; a call without the spare rows
    or committed keys its bucket needs runs a graph of its own exact shape."""
    monkeypatch.setattr(cudnn_sdpa, "PADDED", True)
    lens = []
    monkeypatch.setattr(cudnn_sdpa, "_set_lengths", lambda ptr, T, n, sh: lens.append((ptr, T, n)))
    assert [cudnn_sdpa.bucket(n) for n in (1, 128, 129, 2048, 2049, 2304, 3000, 4096, 4097, 9000)] == \
        [128, 128, 256, 2048, 2304, 2304, 3072, 4096, 4608, 9216]
    hq, hkv, d, S = 4, 1, 64, 4096
    q, k, v, out, ws = arrays(2304, hq, hkv, d, S)
    tail = data_ptr(ws) + cudnn_sdpa.WORKSPACE - cudnn_sdpa._LENS
    for T in (2049, 2100, 2304):                 # one bucket: one graph
        cudnn_sdpa.launch(q[:T], k, v, out[:T], ws, start_pos=0, scale=0.1, stream=None,
                          spare_rows=2304 - T, spare_keys=S - T)
    (g,) = fake.graphs
    assert g.tensors["q"].kw["dim"][2] == 2304 and g.tensors["k"].kw["dim"][2] == 2304
    assert g.sdpa_kw["use_padding_mask"] is True and g.sdpa_kw["diagonal_alignment"] == "bottom_right"
    assert [r[1]["seq_len_q"] for r in fake.runs] == [tail] * 3 and [r[1]["seq_len_kv"] for r in fake.runs] == [tail + 4] * 3
    assert lens == [(tail, 2049, 2049), (tail, 2100, 2100), (tail, 2304, 2304)]
    cudnn_sdpa.launch(q[:300], k, v, out[:300], ws, start_pos=1800, scale=0.1, stream=None,   # cached keys:
                      spare_rows=2004, spare_keys=S - 2100)                                      # 384 x 2304
    assert [fake.graphs[-1].tensors[n].kw["dim"][2] for n in ("q", "k")] == [384, 2304] and lens[-1][1:] == (300, 2100)
    cudnn_sdpa.launch(q[:2100], k, v, out[:2100], ws, start_pos=0, scale=0.1, stream=None,     # keys not committed:
                      spare_rows=204, spare_keys=100)                                            # its own shape
    g = fake.graphs[-1]
    assert len(fake.graphs) == 3 and g.tensors["q"].kw["dim"][2] == 2100 and "use_padding_mask" not in g.sdpa_kw
    assert "seq_len_q" not in fake.runs[-1][1] and len(lens) == 4
    monkeypatch.setattr(cudnn_sdpa, "PADDED", False)      # off: exact shapes, as before
    cudnn_sdpa.launch(q[:2049], k, v, out[:2049], ws, start_pos=0, scale=0.1, stream=None, spare_rows=255,
                      spare_keys=S)
    assert fake.graphs[-1].tensors["q"].kw["dim"][2] == 2049 and len(lens) == 4


def test_a_refused_bucket_falls_back_to_the_exact_shape_and_a_capture_takes_any_kept_graph(fake, monkeypatch):
    """Where cuDNN refuses a bucket's padded graph, the call builds its exact shape (remembered: the bucket is not
    tried again); a call in a capture takes a kept graph that serves it, padded or exact, and builds nothing."""
    monkeypatch.setattr(cudnn_sdpa, "PADDED", True)
    monkeypatch.setattr(cudnn_sdpa, "_set_lengths", lambda *a: None)
    q, k, v, out, ws = arrays(2304, 4, 1, 64, 4096)
    fake.fail_padded = True
    for _ in range(2):
        cudnn_sdpa.launch(q[:2100], k, v, out[:2100], ws, start_pos=0, scale=0.1, stream=None, spare_rows=204,
                          spare_keys=1000)
    assert [g.tensors["q"].kw["dim"][2] for g in fake.graphs] == [2304, 2100] and len(fake.runs) == 2
    assert "padding mask" in cudnn_sdpa._state["graphs"][(2304, 2304, 4, 1, 64, 0.1, (256, 64), (64, 64), (64, 64),
                                                         (256, 64), True)]
    fake.fail_padded = False
    cudnn_sdpa.launch(q[:2200], k, v, out[:2200], ws, start_pos=0, scale=0.1, stream=None, spare_rows=0,
                      spare_keys=0)                     # no spare rows: its exact shape, built eagerly
    fake.capturing["on"] = True
    cudnn_sdpa.launch(q[:2200], k, v, out[:2200], ws, start_pos=0, scale=0.1, stream=None, spare_rows=104,
                      spare_keys=1000)                  # in a capture the bucket would do, but only the exact is kept
    assert len(fake.graphs) == 3 and fake.runs[-1][0] is fake.graphs[2]
    with pytest.raises(cudnn_sdpa.Unsupported, match="capture"):
        cudnn_sdpa.launch(q[:2000], k, v, out[:2000], ws, start_pos=0, scale=0.1, stream=None)
    assert len(fake.graphs) == 3


def test_kept_graphs_are_bounded_and_never_destroyed(fake, monkeypatch):
    """Past the cap a new shape is refused (the caller runs our kernel); a kept graph is never dropped, since
    launches of it may still be in flight."""
    monkeypatch.setattr(cudnn_sdpa, "_GRAPHS_MAX", 2)
    q, k, v, out, ws = arrays(16, 4, 1, 64, 64)
    for sp in (0, 1):
        cudnn_sdpa.launch(q, k, v, out, ws, start_pos=sp, scale=0.1, stream=None)
    with pytest.raises(cudnn_sdpa.Unsupported, match="kept already"):
        cudnn_sdpa.launch(q, k, v, out, ws, start_pos=2, scale=0.1, stream=None)
    cudnn_sdpa.launch(q, k, v, out, ws, start_pos=0, scale=0.1, stream=None)     # a kept shape still runs
    assert len(cudnn_sdpa._state["graphs"]) == 2 and len(fake.graphs) == 2 and len(fake.runs) == 3


def test_an_operand_past_2_31_elements_is_refused(fake):
    q, _, _, out, ws = arrays(16, 4, 1, 64, 64)
    rows = (1 << 13) + 64
    big = np.lib.stride_tricks.as_strided(np.zeros(64, np.uint16), (rows, 1, 64), (2 << 18, 128, 2))  # 256 Ki a row
    with pytest.raises(cudnn_sdpa.Unsupported, match="2\\^31"):
        cudnn_sdpa.launch(q, big, big, out, ws, start_pos=rows - 16, scale=0.1, stream=None)
    assert fake.graphs == []


def test_route_session_requirement_only_where_a_prompt_could_take_cudnn(monkeypatch):
    """Planned where a prompt of the model could take cuDNN and it is wanted; deciding that does not load it."""
    monkeypatch.setattr(ap, "cudnn_wanted", lambda: True)
    monkeypatch.setattr(cudnn_sdpa, "_lib", lambda: pytest.fail("planning loaded cuDNN"))
    assert ap.session_requirement(4096, 32, 8, 128).bytes == cudnn_sdpa.WORKSPACE
    assert ap.session_requirement(2047, 32, 8, 128).bytes == 0      # no prompt of the model reaches the threshold


def test_route_choice():
    """No cuDNN without a session workspace, for short prompts, or where it does not load (this machine: the
    frontend is not installed, or the simulator): ``choose_route`` then keeps our kernels."""
    ws = cudnn_sdpa.WORKSPACE
    assert ap.cudnn_takes(2048, 32, 8, 128) and ap.cudnn_takes(1100, 32, 8, 128, start_pos=1500)
    assert not ap.cudnn_takes(2047, 32, 8, 128) and not ap.cudnn_takes(200, 32, 8, 128, start_pos=30000)
    assert not ap.cudnn_takes(4096, 32, 8, 100)               # D not a multiple of 8
    if not ap.cudnn_usable():
        assert ap.choose_route(4096, 32, 8, 128, session_workspace_bytes=ws) == ap.FUSED_MMA_ASYNC
    if not ap.cudnn_wanted():       # off by default, and not installed here
        assert ap.session_requirement(4096, 32, 8, 128).bytes == 0
    assert ap.workspace_requirement(4096, 32, 8, 128) == ap.NONE     # route=None: never cuDNN's session buffer
    assert ap.workspace_requirement(4096, 32, 8, 128, route=ap.CUDNN).bytes == ws


def test_route_choice_where_cudnn_loads(monkeypatch):
    monkeypatch.setattr(ap, "cudnn_usable", lambda: True)
    ws = cudnn_sdpa.WORKSPACE
    assert ap.choose_route(2048, 32, 8, 128, session_workspace_bytes=ws) == ap.CUDNN
    assert ap.choose_route(2048, 32, 8, 128, session_workspace_bytes=ws - 1) == ap.FUSED_MMA_ASYNC
    assert ap.choose_route(2048, 32, 8, 128) == ap.FUSED_MMA_ASYNC
    assert ap.choose_route(64, 32, 8, 128, session_workspace_bytes=ws) == ap.FUSED_MMA_ASYNC
    assert ap.choose_route(2048, 32, 8, 80, session_workspace_bytes=ws) == ap.CUDNN     # ours: fused_mma
    assert math.isclose(ap.CUDNN_MIN_PAIRS, 2048 * 2049 / 2)


def test_prefill_launch_returns_the_route_that_ran(fake, monkeypatch):
    """``prefill.launch`` says which route ran (``stats()["prefill_attention_routes"]`` counts them): cuDNN for a
    long prompt with a session workspace, where it takes the shape."""
    monkeypatch.setattr(ap, "cudnn_usable", lambda: True)
    q, k, v, out, ws = arrays(2048, 4, 1, 64, 2048)
    assert ap.launch(q, k, v, out, None, start_pos=0, stream=None, session_workspace=ws) == ap.CUDNN
    assert len(fake.runs) == 1
    q0 = q[:0]                                      # no rows: our route named, nothing launched
    assert ap.launch(q0, k, v, out[:0], None, start_pos=0, stream=None, session_workspace=ws) == ap.choose_route(
        0, 4, 1, 64) != ap.CUDNN
    assert len(fake.runs) == 1


def test_prewarm_starts_cudnn_once_on_its_own_thread(fake):
    import threading
    seen = []
    t = cudnn_sdpa.prewarm(8, 2, 64, make_current=lambda: seen.append(threading.current_thread().name))
    t.join(5)
    assert seen == ["vmmstream-cudnn-start"] and len(fake.graphs) == 1       # the model's heads, not kept
    assert [fake.graphs[0].tensors[n].kw["dim"][1] for n in ("q", "k")] == [8, 2]
    assert cudnn_sdpa._state["graphs"] == {} and fake.runs == []
    assert cudnn_sdpa.prewarm(8, 2, 64) is None                              # once a process
    fake.fail = True                 # a failure there is kept, not raised
    cudnn_sdpa._state.pop("prewarm")
    cudnn_sdpa.prewarm(8, 2, 64).join(5)
    assert "no engine" in cudnn_sdpa._state["prewarm_error"]


def test_prewarm_builds_the_prompt_buckets_a_walk_will_look_for(fake, monkeypatch):
    """With ``PADDED``: the start thread also builds the buckets of prompts from the route's threshold up to the
    walk's length (at most ``PREWARM_UP_TO``), under the keys a launch at a prompt's start looks them up by (our q
    layout, the model's cache rows, prefill's scale), so those prompts build nothing."""
    import math
    monkeypatch.setattr(cudnn_sdpa, "PADDED", True)
    monkeypatch.setattr(cudnn_sdpa, "_set_lengths", lambda *a: None)
    hq, hkv, d, layers = 4, 1, 64, 3
    row = layers * 2 * hkv * d
    first = ap.cudnn_min_prompt()
    assert first == 2048 and ap.cudnn_takes(first, hq, hkv, d) and not ap.cudnn_takes(first - 1, hq, hkv, d)
    cudnn_sdpa.prewarm(hq, hkv, d, cache_row=row, max_tokens=3000, min_tokens=first,
                       scale=ap.default_scale(d)).join(5)
    built = [g.tensors["q"].kw["dim"][2] for g in fake.graphs[1:]]
    assert built == cudnn_sdpa.prewarm_buckets(3000, first) == [2048, 2304, 2560, 2816]
    assert cudnn_sdpa.prewarm_buckets(8192, first)[-1] == cudnn_sdpa.PREWARM_UP_TO
    assert all(g.sdpa_kw.get("use_padding_mask") for g in fake.graphs[1:])
    q = np.zeros((3000, hq, d), np.uint16)
    cache = np.zeros((3000, layers, 2, hkv, d), np.uint16)
    ws = np.zeros(cudnn_sdpa.WORKSPACE, np.uint8)
    n = len(fake.graphs)
    for T in (2048, 2100, 2816):
        cudnn_sdpa.launch(q[:T], cache[:, 1, 0], cache[:, 1, 1], q[:T], ws, start_pos=0, scale=1.0 / math.sqrt(d),
                          stream=None, spare_rows=3000 - T, spare_keys=3000 - T)
    assert len(fake.graphs) == n and len(fake.runs) == 3          # all three found built
    cudnn_sdpa._state.pop("prewarm")
    monkeypatch.setattr(cudnn_sdpa, "PADDED", False)              # off: only the engines' start graph
    cudnn_sdpa.prewarm(hq, hkv, d, cache_row=row, max_tokens=3000, min_tokens=first,
                       scale=ap.default_scale(d)).join(5)
    assert len(fake.graphs) == n + 1


def test_installed_is_answered_without_loading(monkeypatch):
    import importlib.util
    monkeypatch.setattr(cudnn_sdpa, "_state", {})
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "cudnn" else None)
    assert cudnn_sdpa.installed() and "lib" not in cudnn_sdpa._state       # found, nothing loaded
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not cudnn_sdpa.installed()
    monkeypatch.setattr(cudnn_sdpa, "_state", {"lib": None, "error": "no libcudnn"})
    assert not cudnn_sdpa.installed()                                       # tried and failed: not offered again
