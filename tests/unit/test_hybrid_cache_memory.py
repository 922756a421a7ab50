"""A hybrid sequence's cache memory is what its layers need: keys and values for its attention
layers only, and for each Gated DeltaNet layer a fixed state (conv window + a dk x dv matrix per v
head) whatever the length. /v1/cluster over the real single-node executor of tiny-qwen35 reports
the bytes its cache allocated, the planner's `sequence_cache_bytes` (behind `tandem plan` and the
fit checks) states the same, and so does it for each TP rank's shard of the heads."""

import torch
from _serving_doubles import CharTokenizer
from fastapi.testclient import TestClient

from tandem.engine.local import LocalExecutor
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.models.kv_cache import KVCache
from tandem.models.llama import Transformer
from tandem.models.presets import get_preset, random_weights
from tandem.parallel.fit import kv_cache_bytes, sequence_cache_bytes
from tandem.parallel.plan import plan_for_config
from tandem.parallel.transform import shard_transformer
from tandem.server.app import create_app

MAX_SEQ = 96


def _executor(name: str) -> LocalExecutor:
    c = get_preset(name).config
    m = Transformer(c)
    m.load_state_dict(random_weights(c, 2, torch.float32), strict=False)  # a tied head: shared
    return LocalExecutor(m.eval(), max_batch=2, max_seq_len=MAX_SEQ, kernels="torch")


def test_the_cluster_view_reports_attention_kv_and_a_fixed_deltanet_state():
    ex = _executor("tiny-qwen35")
    c = ex.model.config
    sched = Scheduler(ex)
    sched.start()
    engine = ServingEngine(sched, CharTokenizer(), "tiny-qwen35")
    try:
        with TestClient(create_app(engine)) as client:
            (rank,) = client.get("/v1/cluster").json()["ranks"]
    finally:
        sched.stop()
    got = rank["shard"]["cache_bytes_per_sequence"]
    one_attention_layer = 2 * MAX_SEQ * c.num_key_value_heads * c.head_dim * 4
    conv, matrix = c.deltanet.state_elements()
    assert got == {"kv": one_attention_layer, "state": 3 * (conv + matrix) * 4}
    assert got == sequence_cache_bytes(c, MAX_SEQ, 4)
    assert kv_cache_bytes(c, 2, MAX_SEQ, 4) == ex.runner.cache.nbytes()
    dense = _executor("tiny-qwen3").describe()["ranks"][0]["shard"]
    assert dense["cache_bytes_per_sequence"]["state"] == 0


def test_each_tp_rank_holds_its_heads_state_as_the_planner_says():
    """TP=2 of tiny-qwen35: each rank's cache (built from its shard) is the planner's figure."""
    c = get_preset("tiny-qwen35").config
    plan = plan_for_config(c, 2)
    for r in range(2):
        model = shard_transformer(c, plan, _Rank(r, 2))
        cache = KVCache.for_model(model, n_slots=1, max_seq_len=MAX_SEQ)
        assert cache.bytes_per_sequence() == sequence_cache_bytes(c, MAX_SEQ, 4, plan=plan, rank=r)


class _Rank:
    """A communicator's identity only: building a shard runs no collective."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
