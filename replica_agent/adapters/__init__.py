"""Engine adapters: move KV blocks between the codec's canonical layout and an engine's cache.

`hf` serves transformers models (`DynamicCache`; `hf_weights` fingerprints their weights,
`hf_tiny` builds the demo's random-weight Llama); `vllm` is a vLLM v1 KV connector
(`KVShareConnector`, with `vllm_options`, `vllm_plan`, `vllm_metadata`, `vllm_store` and
`vllm_layout`); `sglang` is an SGLang HiCache storage backend (`KVShareHiCacheStorage`,
with `sglang_pages`). Only
`vllm` imports vLLM and only `sglang` imports SGLang, and nothing imports either of them
(the engines load them by module path). `settings` (the extra-config keys) is shared;
every store call goes through the replica side's one gate and saver
(`replica_agent.gate`, `replica_agent.saver`), which the transformers agent uses too.
Each adapter is the only place that knows its engine's cache layout.
"""
