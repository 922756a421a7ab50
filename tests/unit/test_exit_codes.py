"""A rank's exit code says why it ended: a heartbeat loss (a silent link, a hung peer) anywhere in
the chain of the exception that ended it gives `PEER_LOST_EXIT`, which the supervisor names, so a
head that sees a worker's exit before its own heartbeat fires still reports a heartbeat loss."""

from tandem.cluster.exits import PEER_LOST_EXIT, exit_cause, exit_code_for
from tandem.transport.heartbeat import PeerLostError
from tandem.transport.socketio import PeerTimeoutError


def test_a_heartbeat_loss_or_an_error_it_caused_exits_with_peer_lost_exit() -> None:
    lost = PeerLostError("rank 1: rank 0 is lost: no heartbeat for 2.0 s", 0)
    assert exit_code_for(lost) == PEER_LOST_EXIT
    try:
        try:
            raise lost
        except PeerLostError as e:
            raise RuntimeError("the step failed") from e
    except RuntimeError as wrapped:
        assert exit_code_for(wrapped) == PEER_LOST_EXIT
    assert "heartbeat lost a ring neighbour" in exit_cause(PEER_LOST_EXIT)


def test_any_other_error_exits_with_one_even_a_plain_peer_timeout() -> None:
    assert exit_code_for(PeerTimeoutError("op timeout")) == 1
    assert exit_code_for(ValueError("bad")) == 1
    e = ValueError("a cycle")
    e.__context__ = ValueError("b")
    e.__context__.__context__ = e  # a chain that loops ends, it is not followed forever
    assert exit_code_for(e) == 1
    assert exit_cause(1) == "code 1"
