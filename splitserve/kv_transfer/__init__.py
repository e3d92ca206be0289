"""KV connectors: move a request's KV blocks between this engine's paged pool and another engine's
(prefill/decode disaggregation) or host memory (the offload tier). `base.py` is the contract the engine
core drives, `pool.py` the worker side's view of the paged pool, `registry.py` builds one by vLLM's name,
`nixl_transport.py` is NIXL under the paged pool."""
