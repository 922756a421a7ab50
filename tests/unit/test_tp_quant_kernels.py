"""TP shards of a GGUF model on tandem's native quantized kernels (csrc/qgemv.c), in process.

The native kernels quantize each row of x to int8 per block of 32 (scale max|x_b| / 127), so a
native TP group is compared with single node on the native kernels, and the reference group
with the reference single node; each case says which kernels each side runs.

What sharding changes on the native kernels:

    column-parallel  nothing: rank r's output is rows [a, b) of the monolith's, bit for bit (each
                     row is its own dot product over the full contraction, on the same int8 x)
    row-parallel     the edges fall on multiples of 32, so the int8 x and every per-block int32
                     dot are the monolith's; only the float32 order of summing the K/32 block
                     products changes (inside each rank, then across ranks):
                         |y_split - y| <= (K/32 + 2) 2^-24 sum_i |x'_i| |w_i|   (per output)

A last-bit change of an activation is not small once the next layer requantizes it: where it
crosses an int8 rounding edge, that element moves by one whole step dx_b, twice the most the
quantization itself moves it (dx_b / 2). So the native pair's logits stay within

    NATIVE_BOUND = 2 delta + LOGIT_ATOL,   delta = max |logits(native single) - logits(reference)|

(the int8 activations' own effect on this model, measured on the same tokens), and greedy ids can
differ only where the reference's top-2 gap is under twice that. On SmolLM2-135M (30 layers) a
last-bit change (fused vs unfused gate/up) already moves single node's logits by 0.77 against a
delta of 1.5; on these 2-layer models the pair differs by 4e-6 (Q8_0) to 0.13 (Q4_K_M).
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.kernels import quant
from tandem.kernels.prepare import prepare
from tandem.kernels.quant_linear import QuantKernelLinear
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.load import load_model
from tandem.loaders.source import open_model
from tandem.models.presets import get_preset
from tandem.models.quant.blocks import BY_NAME, layout
from tandem.models.quant.dequant import dequantize
from tandem.models.quant.linear import QuantLinear
from tandem.models.quant.quantize import quantize
from tandem.parallel.plan import plan_for_source
from tandem.parallel.shard_load import load_shard, quant_types
from tandem.parallel.transform import shard_transformer

pytestmark = pytest.mark.skipif(not quant.available(), reason="no native build")

LOGIT_ATOL = 2e-3  # the reference pair: only the all-reduce's float32 summation order differs
TYPES = ("Q8_0", "Q4_0", "Q4_1", "MXFP4", "Q4_K", "Q5_K", "Q6_K")
# qwen3, 8 q heads of 96 over 2 kv heads: o_proj's head edges (192, 384) miss 256 at TP=2 and 3
ODD = dict(
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=96,
    intermediate_size=768,
    vocab_size=512,
    num_hidden_layers=2,
)
TOKENS = torch.randint(0, 512, (3, 9), generator=torch.Generator().manual_seed(1))  # batch 3


def _blocks(name: str, out: int, k: int, seed: int) -> tuple[torch.Tensor, int]:
    t = BY_NAME[name].type_id
    w = torch.randn(out, k, generator=torch.Generator().manual_seed(seed)).numpy()
    qw = torch.from_numpy(np.ascontiguousarray(quantize(w, t))).view(torch.uint8)
    return qw.reshape(out, -1), t


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 27])  # decode GEMV, batch-3 decode, prefill
def test_a_column_shard_computes_the_monoliths_rows_bit_for_bit(name, rows):
    qw, t = _blocks(name, 96, 768, 0)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1))
    full = QuantKernelLinear([(qw, t)], None, 768)(x)
    for a, b in ((0, 40), (40, 64), (64, 96), (5, 6)):
        part = QuantKernelLinear([(qw[a:b].contiguous(), t)], None, 768)(x)
        assert torch.equal(part, full[:, a:b]), f"{name} rows [{a}, {b})"


@pytest.mark.parametrize("name", TYPES)
def test_a_row_split_on_blocks_changes_only_the_float32_summation_order(name):
    K = 768
    qw, t = _blocks(name, 64, K, 2)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(3))
    y = QuantKernelLinear([(qw, t)], None, K)(x)
    cut = 256 if layout(t).block_size == 256 else 384
    rb = layout(t).row_bytes(cut)
    lo = QuantKernelLinear([(qw[:, :rb].contiguous(), t)], None, cut)(x[:, :cut].contiguous())
    hi = QuantKernelLinear([(qw[:, rb:].contiguous(), t)], None, K - cut)(x[:, cut:].contiguous())
    # |x'| <= |x| + dx / 2 <= 2 max|x_b| per block of 32: a safe magnitude for the int8 rows
    xb = x.abs().view(3, K // 32, 32).amax(-1, keepdim=True).expand(3, K // 32, 32)
    mag = (x.abs() + xb.reshape(3, K)) @ dequantize(qw, t).abs().T  # (3, 64)
    bound = (K / 32 + 2) * 2.0**-24 * mag
    assert ((lo + hi) - y).abs().le(bound).all()


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("odd-native")
    config = replace(get_preset("tiny-qwen3-untied").config, **ODD)
    return {
        q: write_preset_gguf(d / f"odd-{q}.gguf", "tiny-qwen3-untied", q, seed=3, config=config)[1][
            0
        ]
        for q in ("Q8_0", "Q4_0", "K_MIX")
    }


_SINGLE: dict = {}


def _single(path, kernels: str) -> torch.Tensor:
    """Single node's logits (3, 9, vocab) for TOKENS on `kernels`, computed once per file."""
    if (path, kernels) not in _SINGLE:
        model = load_model(open_model(path)).eval()
        prepare(model, kernel=kernels)
        with torch.no_grad():
            _SINGLE[path, kernels] = model(TOKENS)
    return _SINGLE[path, kernels]


def _group(path, tp: int, kernels: tuple[str, ...]):
    """Every rank's (KernelReport, logits or None) for TOKENS, rank r on `kernels[r]`."""
    plan = plan_for_source(open_model(path), tp)

    def body(comm):
        src = open_model(path)
        model = shard_transformer(src.config, plan, comm, qtypes=quant_types(src)).eval()
        load_shard(model, src, plan, comm.rank)
        report = prepare(model, kernel=kernels[comm.rank])
        # the embedding's lookups stay on the reference QuantEmbedding, as on a single node
        kinds = {
            type(m.quant)
            for m in model.modules()
            if isinstance(getattr(m, "quant", None), (QuantLinear, QuantKernelLinear))
        }
        with torch.no_grad():
            return report, kinds, model(TOKENS)

    return plan, run_ranks(ReferenceCommunicator.group(tp), body)


def _assert_close(ref, got, atol: float, what: str) -> None:
    worst = float((ref - got).abs().max())
    assert worst <= atol, f"{what}: logits differ by {worst} (bound {atol})"
    top = torch.topk(ref, 2, dim=-1).values  # (3, 9, 2)
    clear = (top[..., 0] - top[..., 1]) > 2 * atol  # no near-tie: the argmax cannot move
    assert torch.equal(ref.argmax(-1)[clear], got.argmax(-1)[clear]), what


CASES = [("Q8_0", 2), ("Q4_0", 3), ("K_MIX", 2), ("K_MIX", 3)]


@pytest.mark.parametrize("qtype,tp", CASES)
def test_every_rank_multiplies_on_the_native_kernels_and_matches_native_single_node(
    odd_files, qtype, tp
):
    path = odd_files[qtype]
    native, reference = _single(path, "auto"), _single(path, "torch")
    delta = float((native - reference).abs().max())
    plan, ranks = _group(path, tp, ("auto",) * tp)
    for r, (report, kinds, _) in enumerate(ranks):
        # q, k, v, o, gate, up, down per layer and the LM head: every one on the kernel
        assert report.layers.get("quant") == 7 * ODD["num_hidden_layers"] + 1, f"rank {r}"
        assert kinds == {QuantKernelLinear}, f"rank {r}: {kinds}"
    what = f"{qtype} TP={tp} ({plan.o_split}), native ranks vs native single node"
    _assert_close(native, ranks[0][2], 2 * delta + LOGIT_ATOL, what)


@pytest.mark.parametrize("qtype,tp", [("Q4_0", 2), ("K_MIX", 3)])
def test_reference_ranks_match_the_reference_single_node_to_the_summation_order(
    odd_files, qtype, tp
):
    path = odd_files[qtype]
    _, ranks = _group(path, tp, ("torch",) * tp)
    assert all(kinds == {QuantLinear} for _, kinds, _ in ranks)
    _assert_close(_single(path, "torch"), ranks[0][2], LOGIT_ATOL, f"{qtype} TP={tp} reference")


def test_a_native_rank_and_a_reference_rank_agree_in_one_group(odd_files):
    """Rank 0 on the native kernels, rank 1 on the reference modules: each rank's partials are
    its own kernels', the sums are the same on both (float32 on the wire), and the logits lie
    within the native bound of either single node."""
    path = odd_files["K_MIX"]
    native, reference = _single(path, "auto"), _single(path, "torch")
    delta = float((native - reference).abs().max())
    _, ranks = _group(path, 2, ("auto", "torch"))
    assert [kinds for _, kinds, _ in ranks] == [{QuantKernelLinear}, {QuantLinear}]
    for ref, what in ((native, "native"), (reference, "reference")):
        _assert_close(ref, ranks[0][2], 2 * delta + LOGIT_ATOL, f"mixed group vs {what} single")
