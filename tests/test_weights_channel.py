"""The weight-sync group's keyed channel (:mod:`engine.weights.channel`): a stranger's values are refused unread,
nothing is unpickled, and rank 0's store listens only where it was told."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="the hf extra (installed by `nox -s tests`)")

from engine.weights.channel import KeyedGroup, UnsealedValue, new_secret  # noqa: E402
from engine.weights.sync import TcpCommunicator  # noqa: E402


class Payload:
    """Unpickling it runs a command: hostile round 4's way in."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pair(port: int, secret: str, timeout_s: float = 10) -> tuple[KeyedGroup, KeyedGroup]:
    """Rank 0 (the server's side) and rank 1 (the learner), joined: each waits for the other."""
    joined: dict[int, KeyedGroup] = {}
    server = threading.Thread(target=lambda: joined.update(
        {0: KeyedGroup.create("127.0.0.1", port, 0, 2, secret, timeout_s=timeout_s)}))
    server.start()
    joined[1] = KeyedGroup.create("127.0.0.1", port, 1, 2, secret, timeout_s=timeout_s)
    server.join(timeout_s)
    return joined[0], joined[1]


def test_a_tensor_round_trips_bitwise_over_a_real_store():
    port, secret = free_port(), new_secret()
    sent = torch.randn(3, 5, dtype=torch.bfloat16)
    received = torch.empty(3, 5, dtype=torch.bfloat16)
    server, learner = pair(port, secret)
    receiving = threading.Thread(target=lambda: (TcpCommunicator(server).broadcast(received, src=1), server.barrier()))
    receiving.start()
    TcpCommunicator(learner).broadcast(sent, src=1)
    learner.barrier()
    receiving.join(10)
    assert torch.equal(received.view(torch.int16), sent.view(torch.int16))
    assert server.store.num_keys() <= 3, "what was read stays in the store"


def test_a_strangers_pickle_under_the_groups_keys_is_refused_unread(tmp_path):
    """A stranger who knows the old key names (vLLM's ``broadcast_from/<src>/<n>``) writes a pickle there: the
    reader never looks at it; one who somehow wrote under the group's own key is refused by the seal."""
    port, marker = free_port(), tmp_path / "ran"
    server, _learner = pair(port, new_secret(), timeout_s=2)
    stranger = torch.distributed.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5))
    evil = pickle.dumps(Payload(str(marker)))
    for n in range(3):
        stranger.set(f"broadcast_from/1/{n}", evil)
    stranger.set(server._key("b", 1, 0), evil)  # the key itself (a stranger cannot name it: the test can)
    with pytest.raises(UnsealedValue, match="not sealed with this session's secret"):
        server.broadcast_bytes(None, src=1)
    assert not marker.exists()


def test_a_stranger_cannot_pass_for_the_learner_when_the_group_is_joined():
    """The join is a sealed first barrier: a stranger's arrival under the learner's key (were it named) is refused,
    and one who sends nothing leaves rank 0 waiting until its timeout, never joined."""
    port, secret = free_port(), new_secret()
    failed: list[BaseException] = []

    def server() -> None:
        try:
            KeyedGroup.create("127.0.0.1", port, 0, 2, secret, timeout_s=3)
        except BaseException as err:  # the join's failure
            failed.append(err)

    thread = threading.Thread(target=server)
    thread.start()
    time.sleep(0.5)
    stranger = torch.distributed.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5))
    stranger.set(KeyedGroup(stranger, 1, 2, secret)._key("barrier", 0, 1), b"\x80" * 40)  # the key, not the seal
    thread.join(10)
    assert failed and isinstance(failed[0], UnsealedValue), f"rank 0 took a stranger for the learner: {failed}"


def test_a_group_without_the_secret_cannot_be_made():
    with pytest.raises(ValueError, match="group_secret"):
        KeyedGroup(torch.distributed.HashStore(), 0, 2, "")


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as the kernel writes them) of the IPv4 and IPv6 sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


def test_rank_zero_listens_only_on_the_host_it_was_given():
    """torch's ``TCPStore`` alone listens on every interface whatever host it is given (``*:port``); the group
    binds the socket itself and hands it over."""
    port = free_port()
    group, _learner = pair(port, new_secret())
    assert listening_addresses(port) == ["0100007F"], "the store listens beyond 127.0.0.1"
    bare_port = free_port()
    bare = torch.distributed.TCPStore("127.0.0.1", bare_port, None, True, timedelta(seconds=2), wait_for_workers=False)
    assert listening_addresses(bare_port) != ["0100007F"], "torch's own store binds loopback now: the bind is moot"
    del group, bare
