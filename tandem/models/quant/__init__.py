"""GGUF block-quantized weights as plain math: the block-layout table, torch dequantization, and
the reference modules (`QuantLinear`, `QuantEmbedding`) that hold the blocks as stored."""
