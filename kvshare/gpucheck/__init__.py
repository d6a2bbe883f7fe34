"""Checks of the replica agent's device path that play an inference engine: run on a
real GPU by scripts/gpu_check.py and tests/e2e/test_gpu_restore.py, and on the CPU or
the simulated copy engine by the default suite.

`scenarios`: restores and snapshots under busy streams, with a negative control;
`hf_roundtrip`: the transformers adapter through a real store, against a recompute;
`save_stall`: an engine-like loop's step times while the agent saves sealed blocks.
"""
