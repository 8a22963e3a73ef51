"""Causal GQA prefill attention through cuDNN's fused SDPA (the ``nvidia-cudnn-frontend`` Python graph API), the
library's Hopper flash-attention kernels instead of ours for long prompts (``bench/test_bench_attention.py``
compares them with ours and torch SDPA in one run).

Same contract as ``prefill.launch``: q ``[T, Hq, D]`` at positions ``[start_pos, start_pos + T)``, k / v the
layer's sequence-major cache ``[S, Hkv, D]`` (bf16 as uint16), out ``[T, Hq, D]``; query row i sees keys
``[0, start_pos + i]``. cuDNN reads our arrays through their own strides (``[1, H, rows, D]`` with the array's head
and row strides: a layer's K rows in a model's cache are a whole position's row of every layer apart), the mask
is the bottom-right causal diagonal (``n_keys = start_pos + T``), so nothing is copied.

Optional: ``available()`` is False when the frontend or libcudnn cannot be loaded (then ``prefill.choose_route``
keeps our kernels). Everything a call needs is fixed before any capture:

- the workspace is a session-lifetime buffer of ``WORKSPACE`` bytes from the governed pool, shared with the other
  session-workspace users (it runs in stream order between them); a shape whose plan wants more is not taken;
- each shape's graph (T, keys, heads, D, scale, the operands' strides) is built on its first, eager, use and kept
  for the life of the process (up to ``_GRAPHS_MAX``; a graph is never destroyed while launches of it may be in
  flight); a call made while the stream is being captured never builds one, nor starts cuDNN (``Unsupported``:
  the caller runs our kernel instead).

The first graph of a process costs about 1.2 s (cuDNN loading its engines), every new shape after it 40-70 ms
(an H100, run 12-07 k), paid by the first prompt of that length (or chunk): a cost to amortize, the reason the
route is taken only from 2,048 tokens' worth of work. cuDNN's dynamic-shape graphs on one kernel cache would remove
it, but they computed wrong attention on our strided operands (and read out of bounds) on an H100 with cuDNN 9.19
(run 12-07 l), so every graph here is static. ``PADDED`` (off until checked on a GPU) builds one static graph per
length bucket instead (``bucket``: at most 12.5 % more rows), with cuDNN's padding mask reading the call's real
lengths from the workspace's last bytes; a call takes it only where its caller vouches for the rows past its own
(``spare_rows`` of q and out, ``spare_keys`` committed in the cache). ``prewarm`` pays the first on a thread while a model's weights
upload. cuDNN's own device memory (its handle, the engines' modules) is outside the governed pool, like every
kernel module's.
"""

from __future__ import annotations

import threading

from vmmstream.kernels.base.env import switch
from vmmstream.kernels.base.launch import capturing as _capturing, data_ptr, stream_handle as _stream_handle
from vmmstream.kernels.base.workspace import Lifetime, WorkspaceRequirement, check_view

CAPTURE_SAFE = True       # once a shape's graph exists: no allocation, no synchronize (checked by a captured replay)
WORKSPACE = 1 << 20       # cuDNN asked for 256 bytes at every shape measured; the rest is headroom
_LENS = 256               # the workspace's last bytes: a padded graph's two lengths (int32), set on the stream
# one graph per length bucket (``bucket``), cuDNN's padding mask giving the real lengths: off until checked on a
# GPU (exactness, and that rows past the lengths are not used); VMMSTREAM_CUDNN_BUCKETS=1 turns it on
PADDED = switch("VMMSTREAM_CUDNN_BUCKETS", False)
_GRAPHS_MAX = 256         # graphs kept; past that a new shape runs our kernel (a kept graph is never destroyed
                          # while the process runs: one evicted could still have launches in flight)
_SPAN_MAX = 1 << 31       # elements an operand may span: 32-bit offsets in cuDNN's kernels are not ruled out

_lock = threading.Lock()
_state: dict = {}         # "lib", "handle", "graphs": {key: _Graph | str (why refused)}, "error": why not loaded


class Unsupported(RuntimeError):
    """No cuDNN graph for this shape (raised before anything is enqueued: the caller falls back)."""


def workspace_requirement() -> WorkspaceRequirement:
    return WorkspaceRequirement(WORKSPACE, Lifetime.SESSION)


def _lib():
    with _lock:
        if "lib" not in _state:
            try:
                import cudnn
                if cudnn.backend_version() < 90000:
                    raise RuntimeError(f"cuDNN {cudnn.backend_version()} is older than 9.0")
                _state["handle"] = cudnn.create_handle()
                _state["lib"], _state["graphs"] = cudnn, {}
            except Exception as e:          # not installed, no libcudnn, no GPU: the caller falls back
                _state["lib"], _state["error"] = None, f"{type(e).__name__}: {e}"
        return _state["lib"]


PREWARM_UP_TO = 4096      # with ``PADDED``: the start thread also builds the buckets of prompts up to this long


def prewarm(hq: int, hkv: int, d: int, make_current=None, *, cache_row: int = 0, max_tokens: int = 0,
            min_tokens: int = 0, scale: float | None = None) -> threading.Thread | None:
    """Start cuDNN on a thread of its own (its first graph in a process costs about a second, most of it loading
    the library's engines), so that a model's first long prompt does not wait for it: called while a model
    loads. ``make_current``: makes the model's CUDA context current on that thread. The thread holds the lock a
    launch takes, so a launch meanwhile waits for it; a failure here is kept (``unavailable_reason``), never
    raised. Returns the thread (None where one already ran). With ``PADDED``, ``cache_row`` (the elements between
    a layer's consecutive cache rows), ``max_tokens`` (the longest prompt a walk takes), ``min_tokens`` (the
    shortest the route takes) and ``scale`` (the one the model's launches pass): the graphs of the prompt buckets
    between them, up to ``PREWARM_UP_TO`` tokens, are built there too, each under the key a launch from a prompt's
    start will look for."""
    with _lock:
        if "prewarm" in _state:
            return None
        _state["prewarm"] = None

    def run():
        try:
            if make_current is not None:
                make_current()
            cudnn = _lib()
            if cudnn is not None:
                with _lock:
                    _Graph(cudnn, _state["handle"], 256, 256, hq, hkv, d, 1.0 / d ** 0.5,
                           (hq * d, d), (hkv * d, d), (hkv * d, d), (hq * d, d))
                st = ((hq * d, d), (cache_row, d), (cache_row, d), (hq * d, d))
                for T in prewarm_buckets(max_tokens if PADDED and cache_row and scale else 0, min_tokens):
                    with _lock:
                        key = _key(T, T, hq, hkv, d, scale, st, True)
                        if key not in _state["graphs"] and len(_state["graphs"]) < _GRAPHS_MAX:
                            _kept(cudnn, key, st)
        except Exception as e:  # noqa: BLE001  (a launch will meet the same problem and fall back)
            _state["prewarm_error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=run, name="vmmstream-cudnn-start", daemon=True)
    _state["prewarm"] = t
    t.start()
    return t


def prewarm_buckets(max_tokens: int, min_tokens: int) -> list[int]:
    """The bucket lengths ``prewarm`` builds for prompts of ``min_tokens`` (the shortest the route takes) up to
    ``max_tokens`` tokens."""
    out, n = [], max(1, min_tokens)
    while n <= min(max_tokens, PREWARM_UP_TO):
        b = bucket(n)
        if b <= max_tokens:
            out.append(b)
        n = b + 1
    return out


def join_prewarm(timeout: float = 60.0) -> None:
    """Wait for ``prewarm``'s thread (called once the weights are up, before any capture or close)."""
    t = _state.get("prewarm")
    if t is not None and t is not threading.current_thread():
        t.join(timeout)


def installed() -> bool:
    """Whether the frontend package is there, without loading it (nor libcudnn): planning asks this, so that
    loading cuDNN is left to ``prewarm``'s thread."""
    if "lib" in _state:
        return _state["lib"] is not None
    import importlib.util
    try:
        return importlib.util.find_spec("cudnn") is not None
    except (ImportError, ValueError):
        return False


def available() -> bool:
    return _lib() is not None


def unavailable_reason() -> str | None:
    return None if available() else _state.get("error")


def bucket(n: int) -> int:
    """The rows a padded graph is built for: ``n`` rounded up to an eighth of its power of two (at least 128), so
    padding adds at most 12.5 % and a bucket serves every length in it."""
    step = max(128, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


class _Graph:
    """One shape's built graph and its tensors (q, k, v, o; with ``padded``, the lengths sl_q and sl_kv)."""

    def __init__(self, cudnn, handle, T, n_keys, hq, hkv, d, scale, sq, sk, sv, so, padded=False):
        """``sq`` .. ``so``: the (row, head) strides in elements of q, k, v and out (their last axis packed). A
        model's cache is position-major over all layers, so a layer's K rows are far apart: read as they are.
        ``padded``: T and n_keys are a bucket's; the real lengths are read from device memory at each run (the
        padding mask), the bottom-right diagonal aligned to them."""
        bf, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=bf, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

        def desc(name, rows, heads, st):     # [1, H, rows, D] over our [rows, H, D]; the batch stride is unused
            return g.tensor(name=name, dim=[1, heads, rows, d], stride=[rows * st[0], st[1], st[0], 1],
                            data_type=bf)
        self.q, self.k, self.v = desc("q", T, hq, sq), desc("k", n_keys, hkv, sk), desc("v", n_keys, hkv, sv)
        self.padded, lens = padded, {}
        if padded:
            def length(name):
                return g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
            self.sl_q, self.sl_kv = length("seq_len_q"), length("seq_len_kv")
            lens = dict(use_padding_mask=True, seq_len_q=self.sl_q, seq_len_kv=self.sl_kv)
        res = g.sdpa(name="sdpa", q=self.q, k=self.k, v=self.v, attn_scale=float(scale), generate_stats=False,
                     diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0, **lens)
        self.o = res[0] if isinstance(res, (tuple, list)) else res
        self.o.set_output(True).set_dim([1, hq, T, d]).set_stride([T * so[0], so[1], so[0], 1]).set_data_type(bf)
        if hasattr(g, "deselect_workspace_greater_than"):     # only plans that fit the planned workspace
            g.deselect_workspace_greater_than(WORKSPACE - _LENS)
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        self.workspace = int(g.get_workspace_size())
        if self.workspace > WORKSPACE - _LENS:
            raise Unsupported(f"cuDNN SDPA wants {self.workspace} bytes of workspace, more than {WORKSPACE - _LENS}")
        self.graph = g


def _key(rows, keys, hq, hkv, d, scale, st, padded) -> tuple:
    """A kept graph's key: its rows, heads, head dim, scale, the operands' strides, and whether it is padded."""
    return (rows, keys, hq, hkv, d, float(scale), *st, padded)


def _kept(cudnn, key, st):
    """Build the graph of ``key`` (under ``_lock``) and keep it, or keep why cuDNN refused it (a str); returns it."""
    rows, keys, hq, hkv, d, scale = key[:6]
    try:
        g = _Graph(cudnn, _state["handle"], rows, keys, hq, hkv, d, scale, *st, padded=key[-1])
    except Exception as e:  # noqa: BLE001  (cudnnGraphNotSupportedError and kin: this shape is not taken)
        g = f"{type(e).__name__}: {e}"
    _state["graphs"][key] = g
    return g


def _set_lengths(lens_ptr: int, T: int, n_keys: int, stream_handle: int) -> None:
    """The padded graph's real lengths, written on the stream (two memset nodes in a capture: no host memory)."""
    from cuda.bindings import driver as cu
    for i, n in enumerate((T, n_keys)):
        err, = cu.cuMemsetD32Async(lens_ptr + 4 * i, n, 1, stream_handle)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemsetD32Async failed: {err}")


def _strides(a) -> tuple[int, int] | None:
    """(row, head) strides of a [rows, H, D] bf16 array in elements, None unless D is packed and both are
    multiples of 8 elements (16 bytes)."""
    st = getattr(a, "strides", None)
    if st is None or len(st) != 3 or st[2] != 2 or st[0] % 16 or st[1] % 16:
        return None
    return st[0] // 2, st[1] // 2


def launch(q, k, v, out, workspace, *, start_pos: int, scale: float, stream=None, spare_rows: int = 0,
           spare_keys: int = 0) -> None:
    """out = causal GQA attention (the contract above) on ``stream``; ``workspace``: uint8, >= ``WORKSPACE``
    bytes. Raises ``Unsupported`` (nothing enqueued) where cuDNN has no graph for the shape or one would have to
    be built during a capture. ``spare_rows``: rows past T that q and out may be read and written at (their
    buffers' own); ``spare_keys``: committed cache rows past start_pos + T. With ``PADDED`` and enough of both, the
    call runs its length bucket's graph."""
    sh = _stream_handle(stream)
    if "lib" not in _state and _capturing(sh):
        raise Unsupported("cuDNN is not started yet, and it is not started during a capture")
    cudnn = _lib()
    if cudnn is None:
        raise Unsupported(f"cuDNN is not available: {_state.get('error')}")
    T, hq, d = q.shape
    hkv = k.shape[1]
    n_keys = start_pos + T
    check_view("attention_prefill[cudnn]", 0 if workspace is None else workspace.nbytes, WORKSPACE)
    if any(data_ptr(a) % 16 for a in (q, k, v, out)):
        raise Unsupported("the cuDNN route takes 16-byte aligned operands")
    st = [_strides(a) for a in (q, k, v, out)]
    if any(s is None for s in st):
        raise Unsupported("the cuDNN route takes operands whose last axis is packed and rows 16-byte aligned")
    # the graphs that can serve the call: its length bucket's (where the caller vouches for the rows past its own),
    # then its exact shape's; a kept one is taken first, then one is built in that order (never in a capture)
    shapes = ([(bucket(T), bucket(n_keys), True)]
              if PADDED and bucket(T) - T <= spare_rows and bucket(n_keys) - n_keys <= spare_keys else [])
    shapes.append((T, n_keys, False))
    keys = []
    for gt, gk, padded in shapes:
        spans = [(rows - 1) * r + (h - 1) * hs + d for (r, hs), rows, h in zip(st, (gt, gk, gk, gt),
                                                                               (hq, hkv, hkv, hq))]
        if max(spans) < _SPAN_MAX:
            keys.append(_key(gt, gk, hq, hkv, d, scale, st, padded))
    if not keys:
        raise Unsupported(f"an operand spans {max(spans)} elements, past 2^31")
    with _lock:
        graphs = _state["graphs"]
        g = next((graphs[k] for k in keys if isinstance(graphs.get(k), _Graph)), None)
        if g is None:
            if _capturing(sh):
                raise Unsupported("no cuDNN graph for this shape yet, and none is built during a capture")
            why = []
            for key in keys:
                g = graphs.get(key)
                if g is None:
                    if len(graphs) >= _GRAPHS_MAX:
                        raise Unsupported(f"{_GRAPHS_MAX} cuDNN graphs are kept already")
                    g = _kept(cudnn, key, st)       # a str: why cuDNN refused the shape, remembered
                if isinstance(g, _Graph):
                    break
                why.append(g)
            else:
                raise Unsupported(f"cuDNN has no SDPA graph for T={T} keys={n_keys} heads={hq}/{hkv} d={d}: "
                                  + "; ".join(why))
        pack = {g.q: data_ptr(q), g.k: data_ptr(k), g.v: data_ptr(v), g.o: data_ptr(out)}
        if g.padded:
            lens = data_ptr(workspace) + WORKSPACE - _LENS
            _set_lengths(lens, T, n_keys, sh)
            pack.update({g.sl_q: lens, g.sl_kv: lens + 4})
        cudnn.set_stream(handle=_state["handle"], stream=sh)
        g.graph.execute(pack, data_ptr(workspace), handle=_state["handle"])
