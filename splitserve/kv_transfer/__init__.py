"""Moving KV blocks between engines (prefill/decode disaggregation) and to host memory."""
