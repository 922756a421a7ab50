"""A quantized Qwen3.5 hybrid GGUF's TP shards, in process: each rank's DeltaNet projections are
the file's blocks (in_proj_qkv / z / a / b row runs, out_proj column runs on whole blocks), and
the group equals the single node, on the reference modules to the all-reduce's float32 summation
order and on the native kernels (csrc/qgemv.c) within their bound: `NATIVE_BOUND = 2 delta +
LOGIT_ATOL`, delta the native single node's distance from the reference one on the same tokens
(tests/unit/test_tp_quant_kernels.py states why: an int8 activation rounding edge crossed by a
last-bit change moves that element by a whole step).

    Q8_0    tiny-qwen35 with v heads of 32: out_proj blocks of 32, one q/k head a unit, TP=2
    K_MIX   the Q4_K_M mix, hidden 256, 4 q/k heads serving 8 v heads of 128: out_proj in Q4_K,
            a block of 256 spans two v heads, so the q/k heads go 2/2 (`TPPlan.linear_align`)
"""

from dataclasses import replace

import pytest
import torch

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.kernels import quant
from tandem.kernels.prepare import prepare
from tandem.kernels.quant_linear import QuantKernelLinear
from tandem.loaders.gguf.writer import write_model_dir_gguf
from tandem.loaders.load import load_model
from tandem.loaders.make import make_model_dir
from tandem.loaders.source import open_model
from tandem.models.presets import get_preset
from tandem.models.quant.linear import QuantLinear
from tandem.parallel.plan import plan_for_source
from tandem.parallel.shard_load import load_shard, quant_types
from tandem.parallel.transform import shard_transformer

LOGIT_ATOL = 2e-3  # the reference pair: only the all-reduce's float32 summation order differs
SHAPES = {
    "Q8_0": (dict(value_head_dim=32), {}),
    "K_MIX": (
        dict(num_key_heads=4, num_value_heads=8, value_head_dim=128),
        dict(hidden_size=256, intermediate_size=512),
    ),
}
PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
TOKENS = torch.randint(0, 512, (3, 9), generator=torch.Generator().manual_seed(1))  # batch 3


@pytest.fixture(scope="module", params=list(SHAPES))
def hybrid_file(request, tmp_path_factory):
    deltanet, dims = SHAPES[request.param]
    c = get_preset("tiny-qwen35").config
    c = replace(c, deltanet=replace(c.deltanet, **deltanet), **dims)
    d = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    make_model_dir(d / "m", "tiny-qwen35", seed=3, config=c)
    return request.param, write_model_dir_gguf(d / "m", d / "m.gguf", request.param)[0]


def _single(path, kernels: str) -> torch.Tensor:
    model = load_model(open_model(path)).eval()
    prepare(model, kernel=kernels)
    with torch.no_grad():
        return model(TOKENS)  # (3, 9, vocab)


def _group(path, kernels: str):
    """(plan, every rank's (kinds of its DeltaNet projections' modules, logits or None))."""
    plan = plan_for_source(open_model(path), 2)

    def body(comm):
        src = open_model(path)
        model = shard_transformer(src.config, plan, comm, qtypes=quant_types(src)).eval()
        load_shard(model, src, plan, comm.rank)
        prepare(model, kernel=kernels)
        net = model.model.layers["0"].linear_attn
        kinds = {type(getattr(net, p).quant) for p in PROJECTIONS}
        with torch.no_grad():
            return kinds, model(TOKENS)

    return plan, run_ranks(ReferenceCommunicator.group(2), body)


def _assert_close(ref, got, atol: float, what: str) -> None:
    worst = float((ref - got).abs().max())
    assert worst <= atol, f"{what}: logits differ by {worst} (bound {atol})"
    top = torch.topk(ref, 2, dim=-1).values
    clear = (top[..., 0] - top[..., 1]) > 2 * atol  # no near-tie: the argmax cannot move
    assert torch.equal(ref.argmax(-1)[clear], got.argmax(-1)[clear]), what


def test_reference_ranks_hold_deltanet_blocks_and_match_the_reference_single_node(hybrid_file):
    qtype, path = hybrid_file
    plan, ranks = _group(path, "torch")
    assert plan.linear_align == (2 if qtype == "K_MIX" else 1)
    assert all(kinds == {QuantLinear} for kinds, _ in ranks)
    _assert_close(_single(path, "torch"), ranks[0][1], LOGIT_ATOL, f"{qtype} reference")


@pytest.mark.skipif(not quant.available(), reason="no native build")
def test_native_ranks_multiply_deltanet_blocks_and_match_the_native_single_node(hybrid_file):
    qtype, path = hybrid_file
    native, reference = _single(path, "auto"), _single(path, "torch")
    delta = float((native - reference).abs().max())
    _, ranks = _group(path, "auto")
    assert all(kinds == {QuantKernelLinear} for kinds, _ in ranks)
    _assert_close(native, ranks[0][1], 2 * delta + LOGIT_ATOL, f"{qtype} native")
