"""The restorer as it was before concurrent restores got their own staging (commit
1f82cda; docs/gpu.md), unmodified, on the simulated
copy engine: the evidence that the concurrency scenario fails on that code.

    venv/bin/python -m tests.support.sim_pre_fix_restorer

Its source comes from git; its CUDA calls reach tests/support/simcuda.py through a stand-in
`torch` in the module's globals: `torch.cuda.Event`/`current_stream` become simulated
events and streams, pinned and device `torch.empty` become simulated memory, and
`copy_(..., non_blocking=True)` into a device tensor becomes a simulated (late) copy.
Prints one line per run: a single-thread restore, then 2 and 4 threads of different
callers on one restorer (the same scenarios as tests/unit/replica_agent/test_device_sim.py).
Not collected by pytest (the code it runs is gone from the tree).
"""

from __future__ import annotations

import subprocess
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvshare.gpucheck.scenarios import SMALL, concurrent_restores, stalled_restore
from replica_agent.spec import ModelSpec
from tests.support.repo import REPO
from tests.support.simcuda import DEVICE, SimCuda

PRE_FIX_COMMIT = "1f82cda"


def pre_fix_module(sim: SimCuda) -> types.ModuleType:
    source = subprocess.run(
        ["git", "show", f"{PRE_FIX_COMMIT}:replica_agent/device.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout

    def current(_: object) -> types.SimpleNamespace:
        stream = sim.current_stream(DEVICE)
        return types.SimpleNamespace(
            s=stream, synchronize=lambda: sim.synchronize(sim.record(stream))
        )

    class Event:
        def record(self, stream: types.SimpleNamespace) -> None:
            self.event = sim.record(stream.s)

        def synchronize(self) -> None:
            sim.synchronize(self.event)

    class OnDevice(torch.Tensor):
        @classmethod
        def __torch_function__(
            cls,
            func: Callable[..., Any],
            types_: Iterable[type],
            args: Sequence[Any] = (),  # whatever the intercepted torch call was given
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            kwargs = kwargs or {}
            if func is torch.Tensor.copy_ and kwargs.get("non_blocking"):
                dst, src = args[0].as_subclass(torch.Tensor), args[1].as_subclass(torch.Tensor)
                sim.copy(dst, src, current(None).s)
                return args[0]
            # torch leaves Tensor.__torch_function__ unannotated
            return super().__torch_function__(func, types_, args, kwargs)  # type: ignore[no-untyped-call]

    def empty(
        shape: Sequence[int],
        *,
        dtype: torch.dtype,  # the old restorer always names it
        device: torch.device | str | None = None,
        pin_memory: bool = False,
    ) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            return sim.device_tensor(shape, dtype).as_subclass(OnDevice)
        return torch.empty(shape, dtype=dtype)

    stand_in = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if k[0] != "_"})
    stand_in.cuda = types.SimpleNamespace(Event=Event, current_stream=current)
    stand_in.empty = empty
    module = types.ModuleType("pre_fix_device")
    module.__dict__["torch"] = stand_in
    exec(
        compile(source.replace("import torch\n", ""), "pre_fix_device.py", "exec"), module.__dict__
    )
    return module


class PreFixRestorer:
    """The scenarios' interface (`restore` -> (tensor, outcome)) over the old class."""

    def __init__(self, module: types.ModuleType, spec: ModelSpec) -> None:
        self.inner, self.spec, self.device = module.BlockRestorer(spec, "cuda"), spec, DEVICE

    def restore(
        self, payloads: Iterable[bytes | memoryview], count: int
    ) -> tuple[torch.Tensor, None]:
        return self.inner.restore(iter(payloads), count).as_subclass(torch.Tensor), None


def main() -> None:
    sim = SimCuda()
    module = pre_fix_module(sim)
    one = stalled_restore(sim, PreFixRestorer(module, SMALL), count=8)
    print("pre-fix restorer, 1 thread, stalled stream:", one.as_dict())
    for threads in (2, 4):
        for run in range(3):
            restorer = PreFixRestorer(module, SMALL)
            outcomes = concurrent_restores(sim, restorer, threads=threads, count=8)
            print(
                f"pre-fix restorer, {threads} threads, run {run}:", [o.as_dict() for o in outcomes]
            )
    sim.close()


if __name__ == "__main__":
    main()
