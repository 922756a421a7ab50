"""The `--quantize` / `--type` choices (`serve`, `generate`, `quantize`, and `launch`, which passes
serve's flags on) and the writer qtype each names: a table with nothing imported behind it, so a
command that only parses these flags (the `launch` supervisor) loads neither gguf nor numpy."""

K_MIX = "K_MIX"  # Q4_K with Q5_K / Q6_K where llama-quantize's Q4_K_M puts them (`tensor_types`)

# the --quantize / --type choices -> the writer's qtype
QTYPES: dict[str, str] = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K", "q4_k_m": K_MIX}
