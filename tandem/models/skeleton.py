"""`skeleton()`: modules built on the meta device without running their random initializers.

A model is built on the meta device (no memory) before its weights are loaded or its shard is
allocated; every value an initializer would draw is overwritten. On the meta device torch runs
an initializer such as `nn.init.normal_` (nn.Embedding's) through its Python decompositions,
whose first call imports torch._dynamo and sympy: about 70 MB of resident memory in every
process that builds a model, a rank holding half a 0.6B model included. Under `skeleton()` the
initializers return their meta tensor untouched instead; everything else runs as usual.

The override is a TorchFunctionMode: thread-local, so threads building real weights at the same
time are untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

_INITIALIZERS = frozenset(
    (
        nn.init.normal_,
        nn.init.uniform_,
        nn.init.trunc_normal_,
        nn.init.kaiming_uniform_,
        nn.init.kaiming_normal_,
        nn.init.xavier_uniform_,
        nn.init.xavier_normal_,
        Tensor.normal_,
        Tensor.uniform_,
    )
)


class _SkipMetaInit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALIZERS:
            t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(t, Tensor) and t.is_meta:
                return t  # its values are never read: the loader overwrites them
        return func(*args, **kwargs)


@contextmanager
def skeleton() -> Iterator[None]:
    """`with torch.device("meta")`, initializers skipped (module docstring)."""
    with torch.device("meta"), _SkipMetaInit():
        yield
