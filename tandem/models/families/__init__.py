"""One module per model family that differs from the Llama skeleton by more than a switch or two:
what its config.json and its GGUF metadata state, as `ModelConfig` fields, and its GGUF tensor
names. Pure functions of the parsed JSON / metadata, no torch."""
