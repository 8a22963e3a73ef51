ls /usr/local/lib/python3*/dist-packages/nvidia 2>/dev/null; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; pip list 2>/dev/null | grep -i -E "nvidia|cuda|cublas"; find / -name "libcublasLt.so*" 2>/dev/null | head
python3 - <<'PY'
import numpy as np, time
try:
    import nvmath, torch
    print("nvmath", nvmath.__version__)
    from nvmath.linalg.advanced import Matmul
    for m in (16, 512, 1024, 4096):
        a = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16); b = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
        mm = Matmul(a, b.t()); mm.plan(); r = mm.execute(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(20): mm.execute()
        e.record(); e.synchronize(); t = s.elapsed_time(e) / 20 / 1e3
        s.record()
        for _ in range(20): torch.matmul(a, b.t())
        e.record(); e.synchronize(); t2 = s.elapsed_time(e) / 20 / 1e3
        print(m, "nvmath TFLOPs", 2*m*4096*14336/t/1e12, "torch", 2*m*4096*14336/t2/1e12)
except Exception as ex:
    import traceback; traceback.print_exc()
PY
