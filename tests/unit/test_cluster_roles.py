"""What `cluster status` says each rank holds, from the token's layout and the model's config."""

import pytest

from tandem.cli.cluster import ClusterCliError, assign_rank, role_of
from tandem.cluster.token import new_topology
from tandem.models.presets import get_preset


def test_roles_name_each_ranks_stage_layers_and_tp_shard():
    config = get_preset("tiny-qwen3").config
    topo = new_topology(["a", "b", "c", "d"], tp=2, pp=2)
    roles = [role_of(topo, r, config) for r in range(4)]
    assert roles == [
        "stage 0/2 layers [0, 1) | tp shard 0/2 kv heads [0, 1) mlp rows [0, 64)",
        "stage 0/2 layers [0, 1) | tp shard 1/2 kv heads [1, 2) mlp rows [64, 128)",
        "stage 1/2 layers [1, 2) | tp shard 0/2 kv heads [0, 1) mlp rows [0, 64)",
        "stage 1/2 layers [1, 2) | tp shard 1/2 kv heads [1, 2) mlp rows [64, 128)",
    ]
    assert role_of(new_topology(["a"], 1, 1), 0, config) == "layers [0, 2)"
    assert role_of(new_topology(["a", "b"], 2, 1), 1) == "tp shard 1/2"


def test_rank_comes_from_this_machines_address_or_rank_and_ambiguity_is_refused():
    topo = new_topology(["10.0.0.1", "10.0.0.2", "10.0.0.2"], tp=3, pp=1)
    assert assign_rank(topo, None, mine={"10.0.0.1", "127.0.0.1"}) == 0
    assert assign_rank(topo, 2, mine=set()) == 2
    with pytest.raises(ClusterCliError, match="pass --rank"):
        assign_rank(topo, None, mine={"10.0.0.2"})
    with pytest.raises(ClusterCliError, match="pass --rank"):
        assign_rank(topo, None, mine={"192.168.1.9"})
    with pytest.raises(ClusterCliError, match="ranks 0..2"):
        assign_rank(topo, 5)
