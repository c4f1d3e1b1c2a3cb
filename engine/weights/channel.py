"""The weight-sync group's rendezvous on CPU hosts (the ``tcp`` transport): torch's ``TCPStore`` carrying raw bytes
that only the session's secret can name or seal. Nothing read from the store is unpickled.

Why: vLLM's ``StatelessProcessGroup`` (the group ``nccl`` needs) pickles every object it moves through the store, and
the store has no authentication, so any local process that writes one of its keys while a group is open runs code in
the reader (hostile round 4 ran code inside the server that way, with ``ENGINE_API_KEY`` set). Here:

* the **secret** is drawn by the server for each group and handed out only in the answer of the keyed HTTP call that
  opens it (``/init_communicator/``, ``/init_weight_transfer_engine``); every key the group uses is named from it
  (a stranger cannot guess the names), and every value carries an HMAC-SHA256 of key and bytes under it (a value
  that was not sealed with it is refused, never used);
* values are **bytes**: a tensor's raw bytes (the receiver already knows its dtype and shape from the announcement,
  checked before anything arrives), a barrier's arrival a MAC alone;
* the rank that hosts the store **listens on the host it was given** (torch's ``TCPStore`` alone listens on every
  interface: the socket is bound here and handed to it).

>>> from engine.weights.channel import seal, unseal
>>> secret = bytes(32)
>>> unseal(secret, "k", seal(secret, "k", b"weights"))
b'weights'
>>> unseal(secret, "k", b"\\x80\\x04pickled" + bytes(32))  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
engine.weights.channel.UnsealedValue: the value under the group's key 'k' was not sealed with this session's secret...
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
from datetime import timedelta
from typing import Any

MAC_BYTES = 32
SECRET_BYTES = 32


class UnsealedValue(RuntimeError):
    """A value in the group's store that the session's secret did not seal: written by someone else, refused."""


def new_secret() -> str:
    """A fresh group secret, as the server hands it out (hex)."""
    return secrets.token_hex(SECRET_BYTES)


def seal(secret: bytes, key: str, payload: bytes) -> bytes:
    """``payload`` followed by its MAC under ``secret``, bound to ``key`` (a value cannot be moved to another key)."""
    return payload + hmac.new(secret, key.encode() + b"\0" + payload, hashlib.sha256).digest()


def unseal(secret: bytes, key: str, value: bytes) -> bytes:
    """The payload of a sealed ``value``, or :class:`UnsealedValue` when its MAC is not the secret's."""
    payload, mac = value[:-MAC_BYTES], value[-MAC_BYTES:]
    want = hmac.new(secret, key.encode() + b"\0" + payload, hashlib.sha256).digest()
    if len(value) < MAC_BYTES or not hmac.compare_digest(mac, want):
        raise UnsealedValue(f"the value under the group's key {key!r} was not sealed with this session's secret: "
                            "another process wrote into the group's store; nothing of it was used")
    return payload


class KeyedGroup:
    """A group of ``world_size`` ranks over one ``TCPStore`` (rank 0 hosts it on ``host:port``), moving raw bytes
    under keys named from ``secret``: what ``TcpCommunicator`` broadcasts tensors through, and ``barrier``.

    >>> from datetime import timedelta
    >>> from torch.distributed import HashStore
    >>> store = HashStore()  # one process plays both ranks here
    >>> a, b = KeyedGroup(store, 0, 2, "ab" * 32), KeyedGroup(store, 1, 2, "ab" * 32)
    >>> a.broadcast_bytes(b"\\x01\\x02", src=0), b.broadcast_bytes(None, src=0)
    (b'\\x01\\x02', b'\\x01\\x02')
    """

    def __init__(self, store: Any, rank: int, world_size: int, secret: str, listener: socket.socket | None = None):
        if not isinstance(secret, str) or len(secret) != 2 * SECRET_BYTES:
            raise ValueError("a keyed group needs the session's secret: the answer of the call that opened the group "
                             "carries it as 'group_secret'")
        self.store, self.rank, self.world_size = store, rank, world_size
        self._secret = bytes.fromhex(secret)
        self._prefix = hmac.new(self._secret, b"engine-weights/keys", hashlib.sha256).hexdigest()[:32]
        self._listener = listener  # the socket rank 0's store listens on: kept open as long as the store
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._barriers = 0
        self._to_delete: list[str] = []

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, secret: str, timeout_s: float) -> KeyedGroup:
        """Rank 0 binds ``host:port`` itself and hosts the store on that socket; the other ranks connect. Returns
        once every rank has joined (a first barrier, sealed like every value: a stranger cannot fake an arrival),
        or raises after ``timeout_s``."""
        from torch.distributed import TCPStore

        timeout = timedelta(seconds=max(1.0, timeout_s))
        if rank == 0:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(64)
            store = TCPStore(host, port, None, True, timeout, wait_for_workers=False,
                             master_listen_fd=listener.fileno())
            group = cls(store, rank, world_size, secret, listener)
        else:
            group = cls(TCPStore(host, port, None, False, timeout), rank, world_size, secret)
        group.barrier()
        return group

    def _key(self, *parts: object) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    def broadcast_bytes(self, payload: bytes | None, src: int) -> bytes:
        """Send ``payload`` (rank ``src``) or receive it (every other rank: waits for it, then checks its seal)."""
        if self.rank == src:
            if payload is None:
                raise ValueError("the sending rank gives the bytes it broadcasts")
            key = self._key("b", src, self._sent.setdefault(src, 0))
            self._sent[src] += 1
            self.store.set(key, seal(self._secret, key, payload))
            self._to_delete.append(key)
            return payload
        key = self._key("b", src, self._received.setdefault(src, 0))
        self._received[src] += 1
        return unseal(self._secret, key, self.store.get(key))

    def barrier(self) -> None:
        """Wait until every rank arrived here; then what this rank sent before it is read by all and deleted."""
        round_ = self._barriers
        self._barriers += 1
        mine = self._key("barrier", round_, self.rank)
        self.store.set(mine, seal(self._secret, mine, b""))
        for rank in range(self.world_size):
            if rank != self.rank:
                theirs = self._key("barrier", round_, rank)
                unseal(self._secret, theirs, self.store.get(theirs))
        # Every rank arrived, so every rank read what this one sent before the barrier, and finished reading the
        # previous barrier's arrivals: both go (this arrival goes at the next barrier).
        for key in self._to_delete:
            self.store.delete_key(key)
        self._to_delete = [mine]
