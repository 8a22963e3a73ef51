"""Probe: one cuDNN SDPA graph per length bucket (padding mask: seq_len_q / seq_len_kv in device memory,
bottom-right causal) serving every length under it, the design of ``cudnn_sdpa.PADDED``. Checks, against torch SDPA:
real rows exact for T not a bucket multiple and for queries after cached keys; K/V rows past n_keys and q rows past T
filled with NaN must not reach real rows; whether rows of out past T are written. Times: build per bucket, run vs
the exact-shape graph. Needs torch and nvidia-cudnn-frontend on a GPU:
    python3 bench/tools/probe_cudnn_padding.py
"""
import math, time, traceback
import torch
import cudnn
print("torch", torch.__version__, "frontend", getattr(cudnn, "__version__", "?"), "backend", cudnn.backend_version(), flush=True)
dev = torch.device("cuda")
handle = cudnn.create_handle()
cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
Hq, Hkv, D = 32, 8, 128
bf, f32, i32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT, cudnn.data_type.INT32


def build(TP, NKP, S, padded):
    t0 = time.perf_counter()
    g = cudnn.pygraph(io_data_type=bf, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    q = g.tensor(name="q", dim=[1, Hq, TP, D], stride=[TP * Hq * D, D, Hq * D, 1], data_type=bf)
    k = g.tensor(name="k", dim=[1, Hkv, NKP, D], stride=[S * Hkv * D, D, Hkv * D, 1], data_type=bf)
    v = g.tensor(name="v", dim=[1, Hkv, NKP, D], stride=[S * Hkv * D, D, Hkv * D, 1], data_type=bf)
    kw = {}
    sq = skv = None
    if padded:
        sq = g.tensor(name="seq_len_q", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
        skv = g.tensor(name="seq_len_kv", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
        kw = dict(use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv)
    res = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=1.0 / math.sqrt(D), generate_stats=False,
                 diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0, **kw)
    o = res[0] if isinstance(res, (tuple, list)) else res
    o.set_output(True).set_dim([1, Hq, TP, D]).set_stride([TP * Hq * D, D, Hq * D, 1]).set_data_type(bf)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return g, (q, k, v, o, sq, skv), time.perf_counter() - t0


def timed(fn, n=10):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n / 1e3


S = 8192 + 512
kd = torch.randn(S, Hkv, D, dtype=torch.bfloat16, device=dev)
vd = torch.randn(S, Hkv, D, dtype=torch.bfloat16, device=dev)
graphs = {}
for TP, NKP in ((2304, 2304), (4096, 4096), (1024, 4096), (8192, 8192)):
    try:
        graphs[(TP, NKP)] = build(TP, NKP, S, True)
        print(f"bucket T'={TP} keys'={NKP}: build {graphs[(TP, NKP)][2] * 1e3:.0f} ms, ws {graphs[(TP, NKP)][0].get_workspace_size()}", flush=True)
    except Exception:
        traceback.print_exc()
lens = torch.zeros(2, dtype=torch.int32, device=dev)
for T, start, TP, NKP in ((2048, 0, 2304, 2304), (2100, 0, 2304, 2304), (2304, 0, 2304, 2304), (3001, 0, 4096, 4096),
                          (4096, 0, 4096, 4096), (700, 2900, 1024, 4096), (1024, 3072, 1024, 4096), (8000, 0, 8192, 8192)):
    try:
        g, (q, k, v, o, sq, skv), _ = graphs[(TP, NKP)]
        NK = start + T
        kn, vn = kd.clone(), vd.clone()
        kn[NK:] = float("nan"); vn[NK:] = float("nan")
        qd = torch.full((TP, Hq, D), float("nan"), dtype=torch.bfloat16, device=dev)
        qd[:T] = torch.randn(T, Hq, D, dtype=torch.bfloat16, device=dev)
        od = torch.full((TP, Hq, D), 7.0, dtype=torch.bfloat16, device=dev)
        lens[0], lens[1] = T, NK
        ws = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=dev)
        pack = {q: qd.data_ptr(), k: kn.data_ptr(), v: vn.data_ptr(), o: od.data_ptr(), sq: lens[0:1].data_ptr(),
                skv: lens[1:2].data_ptr()}
        run = lambda: g.execute(pack, ws.data_ptr(), handle=handle)
        run(); torch.cuda.synchronize()
        qt, kt, vt = qd[:T].permute(1, 0, 2)[None], kd[:NK].permute(1, 0, 2)[None], vd[:NK].permute(1, 0, 2)[None]
        mask = torch.arange(NK, device=dev)[None, :] <= (start + torch.arange(T, device=dev))[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)[0].permute(1, 0, 2)
        err = (od[:T].float() - want.float()).abs().max().item()
        tail = od[T:]
        tail_state = "none" if tail.numel() == 0 else ("untouched" if bool((tail == 7.0).all()) else
                                                      f"written (nan {bool(tail.isnan().any())}, zero {bool((tail == 0).all())})")
        sec = timed(run)
        ge, (q2, k2, v2, o2, _, _), bt = build(T, NK, S, False)
        ws2 = torch.empty(max(1, ge.get_workspace_size()), dtype=torch.uint8, device=dev)
        od2 = torch.empty(T, Hq, D, dtype=torch.bfloat16, device=dev)
        qx = qd[:T].contiguous()
        pack2 = {q2: qx.data_ptr(), k2: kd.data_ptr(), v2: vd.data_ptr(), o2: od2.data_ptr()}
        sec2 = timed(lambda: ge.execute(pack2, ws2.data_ptr(), handle=handle))
        pairs = T * start + T * (T + 1) // 2
        fl = 4 * D * Hq * pairs
        print(f"T={T} start={start} bucket {TP}/{NKP}: max err {err:.4f}, rows past T {tail_state}; padded "
              f"{sec * 1e6:.0f} us ({fl / sec / 1e12:.0f} TFLOP/s), exact {sec2 * 1e6:.0f} us ({fl / sec2 / 1e12:.0f}), "
              f"exact build {bt * 1e3:.0f} ms", flush=True)
    except Exception:
        traceback.print_exc()
