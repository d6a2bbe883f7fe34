"""Engine adapters: move KV blocks between the codec's canonical layout and an engine's cache.

`hf` serves transformers models (`DynamicCache`); `vllm` is a vLLM v1 KV connector
(`KVShareConnector`, with `vllm_plan`, `vllm_store` and `vllm_layout`; only `vllm`
imports vLLM). Each adapter is the only place that knows its engine's cache layout.
"""
