"""The emulated network's command lists: names, addresses, shaping and teardown by name."""

import pytest

from tandem.bench.netns import EmulatedNetwork, Shaping


def _net(n=3, shaping=Shaping()):
    return EmulatedNetwork(n_hosts=n, shaping=shaping, tag="abc123")


def test_every_created_name_carries_the_run_prefix_and_fits_ifnamsiz():
    net = _net(n=12)
    names = net.namespaces() + [net.host_dev(h) for h in range(12)]
    names += [net.hub_dev(h) for h in range(12)]
    assert all(name.startswith("tdbabc123") for name in names)
    assert all(len(net.host_dev(h)) <= 15 and len(net.hub_dev(h)) <= 15 for h in range(12))
    assert len(set(names)) == len(names)


def test_addresses_are_private_to_the_emulated_subnet():
    net = _net(n=3)
    assert [net.address(h) for h in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    with pytest.raises(ValueError):
        net.address(3)


def test_every_port_is_shaped_on_both_egresses_with_tbf():
    net = _net(n=2, shaping=Shaping(rate_mbit=2500, burst_bytes=262144, queue_ms=50))
    tbf = [c for c in net.setup_commands() if c[0] == "tc"]
    assert len(tbf) == 4
    shaped = {(c[2], c[6]) for c in tbf}
    assert shaped == {
        ("tdbabc123-h0", "tdbabc123h0"),
        ("tdbabc123-hub", "tdbabc123p0"),
        ("tdbabc123-h1", "tdbabc123h1"),
        ("tdbabc123-hub", "tdbabc123p1"),
    }
    assert all(c[7:] == ["root", "tbf", "rate", "2500mbit", "burst", "262144",
                         "latency", "50ms"] for c in tbf)  # fmt: skip
    assert not any("netem" in c for c in net.setup_commands())


def test_unshaped_network_has_no_qdisc():
    assert not [c for c in _net(shaping=None).setup_commands() if c[0] == "tc"]


def test_namespaces_exist_before_links_are_moved_into_them():
    cmds = _net(n=2).setup_commands()
    adds = [i for i, c in enumerate(cmds) if c[:3] == ["ip", "netns", "add"]]
    moves = [i for i, c in enumerate(cmds) if "netns" in c and c[1] == "link"]
    assert max(adds) < min(moves)


def test_teardown_deletes_every_namespace_and_root_side_leftover_by_name():
    net = _net(n=2)
    down = net.teardown_commands()
    assert [c for c in down if c[:3] == ["ip", "netns", "del"]] == [
        ["ip", "netns", "del", ns] for ns in net.namespaces()
    ]
    assert ["ip", "link", "del", "tdbabc123h1"] in down


def test_exec_argv_enters_the_hosts_namespace():
    assert _net().exec_argv(1, ["python", "-V"]) == [
        "ip", "netns", "exec", "tdbabc123-h1", "python", "-V"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [dict(n_hosts=0), dict(n_hosts=2, tag="has space"), dict(n_hosts=2, tag="toolongtag99")],
)
def test_bad_topology_is_a_value_error(kwargs):
    with pytest.raises(ValueError):
        EmulatedNetwork(**{"tag": "abc", **kwargs})


def test_shaping_refuses_a_burst_below_one_gso_segment():
    with pytest.raises(ValueError):
        Shaping(burst_bytes=1500)


def test_new_networks_get_distinct_prefixes():
    assert EmulatedNetwork.new(2).prefix != EmulatedNetwork.new(2).prefix
