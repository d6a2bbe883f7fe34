"""Named model/GPU pairs for the time model, each with where its numbers come from.

`kv_bytes_per_token` is exact arithmetic on the model's published config:
2 (K and V) x layers x KV heads x head dim x 2 bytes (bf16). `prefill_tokens_per_s`
is an estimate: 2 x parameters FLOPs per prompt token against the GPU datasheet's
dense bf16 peak at the model-FLOPs utilisation (MFU) stated, which is what long-prompt
prefill reaches in vLLM/SGLang benchmarks; treat it as +-30%. `kv_capacity_tokens` is
what is left for KV in HBM at vLLM's default gpu_memory_utilization 0.9 after weights
and about 4 GB of activations per GPU — a realistic `--replica-capacity-tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

_GB = 1e9


@dataclass(frozen=True)
class Preset:
    """Prefill speed and KV size of one model served on one GPU type."""

    name: str
    prefill_tokens_per_s: float
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    source: str

    @property
    def break_even_restore_gb_per_s(self) -> float:
        """Restore bandwidth below which fetching a prefix is slower than recomputing it."""
        return self.kv_bytes_per_token * self.prefill_tokens_per_s / _GB


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="llama-3-8b-h100",
            prefill_tokens_per_s=20_000.0,
            kv_bytes_per_token=2 * 32 * 8 * 128 * 2,  # 131,072 B = 128 KiB
            kv_capacity_tokens=400_000,  # (72 GB - 16 GB weights - 4 GB) / 128 KiB
            source=(
                "Meta-Llama-3-8B config.json (32 layers, 8 KV heads, head dim 128); "
                "H100 SXM datasheet 989 TFLOP/s bf16 dense; 16 GFLOP/token at ~32% MFU; "
                "matches the ~20k tokens/s of docs/design.md §12"
            ),
        ),
        Preset(
            name="llama-3-70b-4xh100",
            prefill_tokens_per_s=10_000.0,
            kv_bytes_per_token=2 * 80 * 8 * 128 * 2,  # 327,680 B = 320 KiB (all 4 GPUs)
            kv_capacity_tokens=400_000,  # (4 x 72 GB - 141 GB weights - 16 GB) / 320 KiB
            source=(
                "Meta-Llama-3-70B config.json (80 layers, 8 KV heads, head dim 128), "
                "tensor parallel 4; 4 x 989 TFLOP/s bf16; 141 GFLOP/token at ~35% MFU"
            ),
        ),
        Preset(
            name="qwen2.5-7b-a100",
            prefill_tokens_per_s=8_000.0,
            kv_bytes_per_token=2 * 28 * 4 * 128 * 2,  # 57,344 B = 56 KiB
            kv_capacity_tokens=900_000,  # (72 GB - 15 GB weights - 4 GB) / 56 KiB
            source=(
                "Qwen2.5-7B config.json (28 layers, 4 KV heads, head dim 128); "
                "A100 80GB datasheet 312 TFLOP/s bf16 dense; 15.2 GFLOP/token at ~40% MFU"
            ),
        ),
        Preset(
            name="llama-3-8b-l4",
            prefill_tokens_per_s=3_000.0,
            kv_bytes_per_token=2 * 32 * 8 * 128 * 2,  # 131,072 B = 128 KiB
            kv_capacity_tokens=30_000,  # (21.6 GB - 16 GB weights - 1.6 GB) / 128 KiB
            source=(
                "Meta-Llama-3-8B config.json; L4 datasheet 121 TFLOP/s bf16 dense; "
                "16 GFLOP/token at ~40% MFU; a small-HBM card where local caches are tiny"
            ),
        ),
    )
}

DEFAULT_PRESET = "llama-3-8b-h100"
