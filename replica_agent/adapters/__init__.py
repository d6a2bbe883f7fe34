"""Engine adapters: move KV blocks between the codec's canonical layout and an engine's cache.

`hf` serves transformers models (`DynamicCache`); a vLLM KV-connector adapter comes later.
Each adapter is the only place that knows its engine's cache layout.
"""
