"""The single-device reference model (Llama family) and its KV cache."""
