"""GGUF files: reading, config, weights kept in their blocks, tokenizer."""
