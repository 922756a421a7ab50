"""The single-node CPU path that never imports torch: a GGUF model's forward pass in the native
kernels (csrc/, through ctypes on numpy views of the mapped blocks) and numpy, for the runs where
torch's ~250 MB of resident runtime would be most of the process (a 0.1-1 GB quantized file).

rope.py (the rotary tables, longrope's two sets and partial rotary's kept order), ops.py (numpy faces of the C calls), linear.py (a projection over
row-stacked GGUF parts), model.py (`LeanModel`: weights, KV cache, prefill and decode).
`tandem.engine.lean.LeanExecutor` puts it behind the executor face.
"""
