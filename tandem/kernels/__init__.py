"""The fast paths, swapped in over the reference model in plain sight: tandem's native CPU decode
kernels (csrc/, built on first use), the linear-layer kernel choice, the one-token decode layer."""
