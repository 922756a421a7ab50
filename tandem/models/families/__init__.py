"""Model families stated as their differences from the Llama decoder: each module names the
config.json and GGUF switches of one family and its checkpoint's tensor layout (torch-free)."""
