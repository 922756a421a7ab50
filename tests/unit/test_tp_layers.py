import pytest
import torch
from tp_support import StateDictReader, random_reference, tiny_config

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.comm.solo import SoloCommunicator
from tandem.kernels.linear import prepare_linear_kernels
from tandem.parallel.plan import make_tp_plan, plan_for_config
from tandem.parallel.shard_load import load_shard
from tandem.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from tandem.parallel.transform import TransformError, shard_transformer

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def _sharded_logits(config, ref, n, weights=None, tokens=None, run=None):
    """Every rank's `run(model)` (default: the logits of `tokens`) on its loaded shard."""
    plan = plan_for_config(config, n, weights)
    state = ref.state_dict()

    def body(comm):
        model = shard_transformer(config, plan, comm)
        load_shard(model, StateDictReader(state), plan, comm.rank)
        with torch.no_grad():
            return model(tokens) if run is None else run(model)

    return run_ranks(ReferenceCommunicator.group(n), body)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp1_through_parallel_layers_is_bit_exact_with_reference(arch):
    """The parallel layers multiply through `kernels.linear.linear`, as the monolith's prepared
    linear layers do: the reference with its linear layers on that kernel (its attention and norms
    its own, as the shard's) gives the same bits."""
    config = tiny_config(
        arch, o_bias=arch == "LlamaForCausalLM", mlp_bias=arch == "LlamaForCausalLM"
    )
    ref = random_reference(config)
    tokens = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    plan = plan_for_config(config, 1)
    model = shard_transformer(config, plan, SoloCommunicator())
    load_shard(model, StateDictReader(ref.state_dict()), plan, 0)
    prepare_linear_kernels(ref, fuse=False)
    assert isinstance(model.model.layers["0"].self_attn.o_proj, RowParallelLinear)
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens))


@pytest.mark.parametrize("n,weights", [(2, None), (3, None), (2, (2.0, 1.0))])
@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_model_matches_reference_logits_in_process(arch, n, weights):
    config = tiny_config(arch)
    ref = random_reference(config)
    tokens = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(2))
    outs = _sharded_logits(config, ref, n, weights, tokens)
    with torch.no_grad():
        expected = ref(tokens)
    assert outs[0].shape == expected.shape
    assert (outs[0] - expected).abs().max().item() < 1e-4
    assert all(o is None for o in outs[1:])


def test_shards_hold_only_their_part():
    config = tiny_config()
    plan = make_tp_plan(
        world_size=3, n_heads=8, n_kv_heads=4, head_dim=16, intermediate_size=128, vocab_size=96
    )

    def body(comm):
        m = shard_transformer(config, plan, comm)
        attn, mlp = m.model.layers["1"].self_attn, m.model.layers["1"].mlp
        return (
            attn.n_heads,
            attn.n_kv_heads,
            tuple(attn.q_proj.weight.shape),
            tuple(attn.o_proj.weight.shape),
            tuple(mlp.down_proj.weight.shape),
            tuple(m.model.embed_tokens.weight.shape),
            m.lm_head.weight is m.model.embed_tokens.weight,
        )

    got = run_ranks(ReferenceCommunicator.group(3), body)
    assert got == [
        (4, 2, (64, 64), (64, 64), (64, 64), (32, 64), True),
        (2, 1, (32, 64), (64, 32), (64, 32), (32, 64), True),
        (2, 1, (32, 64), (64, 32), (64, 32), (32, 64), True),
    ]


def test_column_then_row_parallel_equals_the_monolith():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 16, generator=g)
    a = torch.randn(24, 16, generator=g)
    b = torch.randn(16, 24, generator=g)
    bias = torch.randn(16, generator=g)
    bounds = [(0, 16), (16, 24)]

    def body(comm):
        lo, hi = bounds[comm.rank]
        col = ColumnParallelLinear(16, hi - lo, False)
        row = RowParallelLinear(hi - lo, 16, True, comm)
        with torch.no_grad():
            col.weight.copy_(a[lo:hi])
            row.weight.copy_(b[:, lo:hi])
            row.bias.copy_(bias)
            y_col = col(x)
            return (y_col - (x @ a.T)[..., lo:hi]).abs().max().item(), row(y_col)

    outs = run_ranks(ReferenceCommunicator.group(2), body)
    assert outs[0][0] < 1e-5 and outs[1][0] < 1e-5  # each column shard is the monolith's slice
    assert torch.equal(outs[0][1], outs[1][1])  # the all-reduce leaves every rank identical
    assert (outs[0][1] - ((x @ a.T) @ b.T + bias)).abs().max() < 1e-4


def test_vocab_parallel_embedding_is_bit_exact_and_logits_reach_rank0_only():
    g = torch.Generator().manual_seed(4)
    table = torch.randn(10, 8, generator=g)
    ids = torch.tensor([[0, 3, 9, 5], [6, 7, 1, 2]])
    h = torch.randn(2, 8, generator=g)
    shards = [(0, 4), (4, 7), (7, 10)]

    def body(comm):
        lo, hi = shards[comm.rank]
        emb = VocabParallelEmbedding(lo, hi, 8, comm)
        head = VocabParallelLMHead(lo, hi, 8, comm, weight=emb.weight)
        with torch.no_grad():
            emb.weight.copy_(table[lo:hi])
            return emb(ids), head(h)

    outs = run_ranks(ReferenceCommunicator.group(3), body)
    for rows, _ in outs:
        assert torch.equal(rows, table[ids])
    assert (outs[0][1] - h @ table.T).abs().max() < 1e-5
    assert outs[1][1] is None and outs[2][1] is None


def test_plan_and_communicator_of_different_sizes_are_refused():
    config = tiny_config()
    with pytest.raises(TransformError):
        shard_transformer(config, plan_for_config(config, 2), SoloCommunicator())


@pytest.mark.parametrize(
    "kv,n,weights", [(2, 3, None), (1, 2, None), (1, 2, (2.0, 1.0)), (1, 4, None)]
)
def test_replicated_kv_heads_match_reference(kv, n, weights):
    config = tiny_config("MistralForCausalLM", num_attention_heads=4, num_key_value_heads=kv)
    ref = random_reference(config)
    tokens = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))
    outs = _sharded_logits(config, ref, n, weights, tokens)
    with torch.no_grad():
        assert (outs[0] - ref(tokens)).abs().max().item() < 1e-4


def test_pick_argmax_takes_the_first_rank_holding_the_maximum_like_torch_argmax():
    from tandem.parallel.tensor import pick_argmax

    g = torch.Generator().manual_seed(5)
    for trial in range(200):
        sizes = [int(v) for v in torch.randint(1, 6, (3,), generator=g)]
        # few distinct values, so equal maxima inside a slice and across slices are common
        row = torch.randint(0, 3, (sum(sizes),), generator=g).float()
        parts, start, pairs = row.split(sizes), 0, []
        for part in parts:
            best, idx = part.max(-1, keepdim=True)
            pairs += [best, (idx + start).float()]
            start += part.numel()
        assert int(pick_argmax(torch.cat(pairs))) == int(row.argmax()), (trial, row, sizes)


@pytest.mark.parametrize("n,weights", [(2, None), (3, None), (2, (2.0, 1.0))])
def test_vocab_parallel_argmax_equals_argmax_of_the_gathered_logits(n, weights):
    config = tiny_config("Qwen3ForCausalLM")
    ref = random_reference(config)
    tokens = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(4))

    def argmax(model):
        h = model.forward_layers(model.embed(tokens), model.context([0] * 3, [9] * 3))
        return model.head_argmax(h)

    outs = _sharded_logits(config, ref, n, weights, run=argmax)
    with torch.no_grad():
        assert torch.equal(outs[0], ref(tokens).argmax(-1))
    assert all(o is None for o in outs[1:])


def test_vocab_beyond_float32_exact_integers_is_refused_for_tp():
    config = tiny_config("Qwen3ForCausalLM")
    import dataclasses

    huge = dataclasses.replace(config, vocab_size=2**24 + 8)
    with pytest.raises(TransformError, match="2\\^24"):
        shard_transformer(huge, plan_for_config(huge, 2), ReferenceCommunicator.group(2)[0])
