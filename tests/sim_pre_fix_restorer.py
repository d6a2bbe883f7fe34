"""Today's (pre-fix, commit 1f82cda) BlockRestorer, unmodified, on the simulated copy engine.

Its CUDA calls are routed to tests/simcuda.py through a stand-in `torch` in the module's
globals: torch.cuda.Event/current_stream -> sim events/streams, pinned/device empty ->
sim memory, and `copy_(..., non_blocking=True)` on device tensors -> a sim copy.
"""

import sys
import types

import torch

sys.path.insert(0, "/work/wt/gpu")
from tests.gpu_scenarios import SMALL, concurrent_restores, stalled_restore
from tests.simcuda import DEVICE, SimCuda

sim = SimCuda()


class Dev(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and kwargs.get("non_blocking"):
            dst, src = args[0], args[1]
            plain_dst = dst.as_subclass(torch.Tensor)
            sim.copy(plain_dst, src.as_subclass(torch.Tensor), FakeCuda.current_stream(None).s)
            return dst
        return super().__torch_function__(func, types_, args, kwargs)


class FakeStream:
    def __init__(self, s):
        self.s = s

    def synchronize(self):
        sim.synchronize(sim.record(self.s))


class FakeEvent:
    def record(self, stream):
        self.e = sim.record(stream.s)

    def synchronize(self):
        sim.synchronize(self.e)


class FakeCuda:
    Event = FakeEvent

    @staticmethod
    def current_stream(device):
        return FakeStream(sim.current_stream(DEVICE))


def empty(shape, dtype=None, device=None, pin_memory=False):
    if device is not None and torch.device(device).type == "cuda":
        return sim.device_tensor(shape, dtype).as_subclass(Dev)
    return torch.empty(shape, dtype=dtype)


fake = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
fake.cuda, fake.empty = FakeCuda, empty
module = types.ModuleType("old_device")
module.__dict__["__name__"] = "old_device"
src = open("/tmp/legacy/old_device.py").read().replace("import torch\n", "")
module.__dict__["torch"] = fake
exec(compile(src, "old_device.py", "exec"), module.__dict__)


class OldAdapter:
    """The scenario calls restore() -> (tensor, outcome); today's returns a tensor."""

    def __init__(self):
        self.inner = module.BlockRestorer(SMALL, "cuda")
        self.spec, self.device = SMALL, DEVICE

    def restore(self, payloads, n):
        return self.inner.restore(payloads, n).as_subclass(torch.Tensor), None


single = stalled_restore(sim, OldAdapter(), count=8)
print("today's code, one thread, stalled stream:", single.as_dict())
for threads in (2, 4):
    for run in range(3):
        restorer = OldAdapter()
        outcomes = concurrent_restores(sim, restorer, threads=threads, count=8)
        print(f"today's code, {threads} threads, run {run}:", [o.as_dict() for o in outcomes])
sim.close()
