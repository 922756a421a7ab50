"""Random transformers models whose logits are not ties: transformers initializes weights with
std 0.02, which leaves a random model's logits nearly flat, so greedy comparisons would hinge on
near-ties. `spread_` redraws them in place."""

import torch


@torch.no_grad()
def spread_(model: torch.nn.Module, matrix_std: float | None = None, head_gain: float = 1.0):
    """Every matrix (experts stacked (E, out, in) included) drawn N(0, matrix_std), or at unit
    gain, N(0, fan_in^-1/2), where `matrix_std` is None; a conv's K taps (C, 1, K) and a Gated
    DeltaNet's gate projections (`in_proj_a`, `in_proj_b`) always at unit gain; `lm_head.weight`
    `head_gain` times its std; every vector (norms, biases) moved by N(0, 0.1). Returns `model`.

    The gates at N(0, 0.25) saturate softplus and sigmoid, where the recurrence turns a float32
    rounding of those projections into ~1e-4 at the logits (measured on the tiny Qwen3.5 at
    K = 64: transformers' own float32 run is 1.3e-5 from its float64 run, tandem's 1.1e-4 and
    1.1e-5 by the rounding of `in_proj_a`/`in_proj_b` alone), which a 1e-4 comparison cannot
    tell from an error."""
    for name, p in model.named_parameters():
        unit = p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.0
        gate = name.endswith(("in_proj_a.weight", "in_proj_b.weight"))
        if name.endswith("conv1d.weight") or gate or (p.dim() >= 2 and matrix_std is None):
            std = unit
        elif p.dim() >= 2:
            std = matrix_std
        else:
            p.add_(torch.randn_like(p) * 0.1)
            continue
        p.normal_(0, std * (head_gain if name == "lm_head.weight" else 1.0))
    return model
