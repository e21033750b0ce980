"""First-call (compile) time of the Triton memory at one shape, then warm step times: one JSON line to stdout."""
import json, sys, time
import torch
from titans.bench.memory import _build

dim, heads, expansion = map(int, sys.argv[1:4])
model = _build("titans", dim, heads, 2, expansion, 16, "triton").cuda()
x = torch.randn(4, 1024, dim, device="cuda")
out = {"dim": dim, "heads": heads, "expansion": expansion, "state": [dim // heads, dim // heads * expansion]}
def timed(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize(); return time.perf_counter() - t
try:
    with torch.no_grad():
        out["first_forward_s"] = timed(lambda: model(x))
    out["first_train_step_s"] = timed(lambda: model(x)[0].pow(2).mean().backward())
    out["warm_train_step_s"] = timed(lambda: model(x)[0].pow(2).mean().backward())
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"[:500]
print(json.dumps(out), flush=True)
