import pytest
import torch
from tp_support import tiny_config, write_random_model

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.comm.solo import SoloCommunicator
from tandem.kernels.linear import prepare_linear_kernels
from tandem.loaders.load import load_model
from tandem.loaders.safetensors_dir import ModelDir, TensorShapeError
from tandem.parallel.plan import plan_for_config
from tandem.parallel.shard_load import ShardLoadError, load_shard, slice_spec
from tandem.parallel.transform import shard_transformer


class RecordingReader:
    """A ModelDir, recording every read (name, dim, start, end)."""

    def __init__(self, md):
        self.md, self.reads = md, []

    def read(self, name, dim=None, start=None, end=None, experts=None):
        self.reads.append((name, dim, start, end))
        return self.md.read(name, dim, start, end, experts)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = tiny_config("Qwen3ForCausalLM", num_attention_heads=8, num_key_value_heads=4)
    return write_random_model(tmp_path_factory.mktemp("shard") / "m", config)


def test_tp1_from_the_checkpoint_is_bit_exact_with_the_reference_loader(model_dir):
    md = ModelDir(model_dir)
    ref = load_model(md)
    prepare_linear_kernels(ref, fuse=False)  # the kernel the parallel layers multiply through
    plan = plan_for_config(md.config, 1)
    model = shard_transformer(md.config, plan, SoloCommunicator())
    load_shard(model, md, plan, 0)
    tokens = torch.randint(
        0, md.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens))


def test_each_rank_reads_only_its_own_slices(model_dir):
    md = ModelDir(model_dir)
    plan = plan_for_config(md.config, 2)
    total = sum(info.nbytes for info in md.manifest.values())

    def body(comm):
        reader = RecordingReader(ModelDir(model_dir))
        model = shard_transformer(md.config, plan, comm)
        nbytes = load_shard(model, reader, plan, comm.rank)
        return reader.reads, nbytes

    results = run_ranks(ReferenceCommunicator.group(2), body)
    partitioned = [n for n in md.manifest if slice_spec(n, plan, 0) is not None]
    assert partitioned
    for reads, nbytes in results:
        full_reads = {name for name, dim, _, _ in reads if dim is None}
        assert not full_reads & set(partitioned)  # no partitioned tensor is read whole
        assert nbytes < 0.6 * total
    for name in partitioned:  # the two ranks' slices tile each tensor exactly
        (d0, a0, b0), (d1, a1, b1) = (slice_spec(name, plan, r) for r in (0, 1))
        assert d0 == d1 and a0 == 0 and b0 == a1 and b1 == md.info(name).shape[d0]


def test_a_checkpoint_of_another_shape_is_refused(model_dir, tmp_path):
    md = ModelDir(model_dir)
    other = tiny_config(
        "Qwen3ForCausalLM", num_attention_heads=8, num_key_value_heads=4, intermediate_size=192
    )
    plan = plan_for_config(other, 1)
    model = shard_transformer(other, plan, SoloCommunicator())
    with pytest.raises((ShardLoadError, TensorShapeError), match="mlp"):
        load_shard(model, md, plan, 0)
