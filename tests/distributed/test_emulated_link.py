"""A real emulated 2.5 GbE link between two namespaces (root with iproute2 only; a second or two)."""

import subprocess

import pytest

from tandem.bench.hosts import Hosts
from tandem.bench.netns import EmulatedNetwork, NetnsUnavailable, Shaping, check_available


def _skip_unless_netns():
    try:
        check_available()
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    probe = EmulatedNetwork.new(1, shaping=None)
    try:
        with probe.up():
            pass
    except Exception as e:  # a container without CAP_NET_ADMIN refuses `ip netns add`
        pytest.skip(f"network namespaces refused here: {e}")


def test_shaped_link_carries_tcp_no_faster_than_its_tbf_rate_and_is_torn_down():
    _skip_unless_netns()
    shaping = Shaping(rate_mbit=2500)
    net = EmulatedNetwork.new(2, shaping)
    with net.up(), Hosts(2, net) as hosts:
        figures = hosts.measure_link(0, 1, payload_bytes=16 << 20)
        tx, _ = net.tx_rx_bytes(0)
    assert 0 < figures.goodput_bytes_per_s <= shaping.rate_bytes_per_s * 1.05
    assert tx >= 16 << 20  # the payload really crossed host 0's port
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.prefix not in listed


def test_network_is_torn_down_when_the_body_raises():
    _skip_unless_netns()
    net = EmulatedNetwork.new(2, Shaping())
    with pytest.raises(RuntimeError, match="boom"), net.up():
        raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.prefix not in listed
