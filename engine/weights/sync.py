"""Weight sync between a learner and the served engine, as ms-swift's GRPO server mode does it: the learner opens a
group with the server's workers (``/init_communicator/``), announces each push over HTTP (``/update_named_param/``:
name, dtype, shape; ``/update_flattened_params/``: swift's ``FlattenedTensorMetadata`` list), then broadcasts the
tensor to them; every worker loads what it received into its model.

Two transports carry the tensor, over one ``StatelessProcessGroup`` (vLLM's TCP-store group, rank 0 a server
worker, the learner last):

* ``nccl`` -- vLLM's ``PyNcclCommunicator`` on the GPU, what swift's ``VLLMClient`` speaks (CUDA hosts);
* ``tcp`` -- :class:`TcpCommunicator`, the tensor pickled through the group's TCP store: for CPU hosts and learners
  without NCCL (every byte crosses the store, so it suits small models and tests, not a 7B model per step).

The server picks ``nccl`` on CUDA hosts and ``tcp`` elsewhere unless the learner names one. What is received and
how it is cut is written once here, for the vLLM worker extension and the HF backend alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import RequestError

TRANSPORTS = ("nccl", "tcp")


class TcpCommunicator:
    """The part of ``PyNcclCommunicator`` weight sync uses (``rank``, ``device``, ``group``, ``broadcast``), over the
    group's keyed TCP store (:class:`engine.weights.channel.KeyedGroup`), on the CPU: a tensor travels as its raw
    bytes, sealed with the session's secret, and is received into a tensor whose dtype and shape the announcement gave
    (nothing is unpickled).

    >>> import torch
    >>> from torch.distributed import HashStore
    >>> from engine.weights.channel import KeyedGroup
    >>> store = HashStore()  # one process plays both ranks of a group here
    >>> learner = TcpCommunicator(KeyedGroup(store, 1, 2, "5e" * 32))
    >>> worker = TcpCommunicator(KeyedGroup(store, 0, 2, "5e" * 32))
    >>> learner.broadcast(torch.ones(2), src=1)
    >>> received = torch.empty(2); worker.broadcast(received, src=1); received.tolist()
    [1.0, 1.0]
    """

    def __init__(self, group: Any, rank: int | None = None) -> None:
        import torch

        self.group = group
        self.rank = group.rank if rank is None else rank
        self.device = torch.device("cpu")

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        """Send ``tensor`` (rank ``src``) or receive into it (every other rank), as NCCL's broadcast does."""
        import torch

        if self.rank == src:
            raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self.group.broadcast_bytes(raw.numpy().tobytes(), src=src)
            return
        payload = self.group.broadcast_bytes(None, src=src)
        size = tensor.numel() * tensor.element_size()
        if len(payload) != size:
            raise RuntimeError(f"the learner sent {len(payload)} bytes for a tensor of {size} bytes "
                               f"({list(tensor.shape)}, {tensor.dtype}): the push and its announcement disagree")
        if size:
            tensor.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(tensor.dtype)
                         .reshape(tensor.shape))


def check_transport(transport: Any) -> str:
    """The transport a request names (None: this host's default), refused by name when unknown."""
    if transport is None:
        from engine.backends.host import has_cuda

        return "nccl" if has_cuda() else "tcp"
    if transport not in TRANSPORTS:
        raise RequestError("transport", transport, f"must be one of {', '.join(TRANSPORTS)}",
                           fix="leave it out for this host's default (nccl with CUDA, tcp without)")
    return str(transport)


def open_communicator(host: str, port: int, rank: int, world_size: int, transport: str, device: Any = None,
                      timeout_s: float = 300.0, learner_rank: int | None = None, secret: str | None = None) -> Any:
    """Join the learner's group as ``rank`` (rank 0 hosts its TCP store on ``host:port``) with ``transport``; rank
    0 waits ``timeout_s`` at most for the others to join. The learner is the group's last rank (swift's layout)
    unless ``learner_rank`` says otherwise (vLLM's weight-transfer layout: the trainer is rank 0); the communicator
    carries it as ``learner_rank``, the rank every receive takes tensors from.

    ``tcp`` moves sealed bytes under keys named from ``secret`` (the session's, from the answer of the keyed call that
    opened the group: :mod:`engine.weights.channel`); ``nccl`` rendezvouses through vLLM's ``StatelessProcessGroup``,
    which is what swift's and TRL's clients speak (docs/serving.md says what it exposes)."""
    if transport == "nccl":
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                             store_timeout=max(1, int(timeout_s)))
        communicator: Any = PyNcclCommunicator(group, device=device)
    else:
        from engine.weights.channel import KeyedGroup

        communicator = TcpCommunicator(KeyedGroup.create(host, port, rank, world_size, secret or "", timeout_s))
    communicator.learner_rank = world_size - 1 if learner_rank is None else learner_rank
    return communicator


class Joining:
    """A learner group being joined on a thread of its own (rank 0's store waits for the learner): the caller goes
    on (generation is never held back by a learner that is slow to join), and :meth:`joined` waits for the group or
    raises the join's failure (e.g. the learner never came within the timeout).

    >>> Joining(lambda: "group").joined()
    'group'
    """

    def __init__(self, join: Any) -> None:
        import threading

        self._result: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._result = join()
            except BaseException as err:  # kept for joined(): the join's failure is the next weight call's
                self._error = err

        self._thread = threading.Thread(target=run, name="engine-weight-join", daemon=True)
        self._thread.start()

    def joined(self, timeout_s: float | None = None) -> Any:
        """The group, once joined; a join still under way after ``timeout_s`` is this call's failure (the join
        itself goes on: a later call may still find it joined)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the learner has not joined the group within {timeout_s:.0f} s of this push: "
                               "a learner joins right after its init call")
        if self._error is not None:
            raise RuntimeError(f"the learner's group could not be joined: {self._error}") from self._error
        return self._result


def announced_tensors(announced: Mapping[str, Any]) -> list[tuple[str, str, Sequence[int]]]:
    """(field, name, shape) of every tensor a push announces (a named one, a bucket's, or vLLM's listed ones)."""
    if "metadatas" in announced:
        return [(f"metadatas[{i}].name", m["name"], m["shape"]) for i, m in enumerate(announced["metadatas"])]
    if "tensors" in announced:
        return [(f"update_info.names[{i}]", t["name"], t["shape"]) for i, t in enumerate(announced["tensors"])]
    return [("name", announced["name"], announced["shape"])]


def receive(joining: Joining | None, announced: Mapping[str, Any], within_s: float) -> list[tuple[str, Any]]:
    """What a push announced, from the learner, as (name, tensor) pairs: the group must be joined and every byte
    arrived within ``within_s`` of the push (``serve.weight_sync_session_timeout_s``), so a learner that announces
    and never sends holds nothing longer than that (over ``tcp``; NCCL's broadcast has no deadline)."""
    import time

    if joining is None:
        raise RuntimeError("no learner group is open: call /init_communicator/ (or /init_weight_transfer_engine) "
                           "first")
    deadline = time.monotonic() + within_s
    communicator = joining.joined(within_s)
    set_timeout = getattr(communicator.group.store, "set_timeout", None)
    if set_timeout is not None:
        from datetime import timedelta

        set_timeout(timedelta(seconds=max(1.0, deadline - time.monotonic())))
    if "metadatas" in announced:
        return receive_flattened(communicator, announced["metadatas"])
    if "tensors" in announced:
        return receive_listed(communicator, announced)
    return receive_named(communicator, announced["name"], announced["dtype"], announced["shape"])


WIDE_OPEN = frozenset({"0.0.0.0", "::", ""})
"""The wildcard addresses swift's client asks the server to bind its group store on."""
LOOPBACK_NAMES = frozenset({"localhost"})
WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "float64")
MAX_TENSOR_ELEMENTS = 2**36
"""Most elements one announced tensor may have (256 GiB in float32): a shape beyond it is no model's."""


def _is_loopback(address: str) -> bool:
    """An address of this machine's loopback: ``localhost``, or an IP address (not a name that merely starts with
    ``127.``) in 127.0.0.0/8 or ``::1``."""
    import ipaddress

    if address in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def store_host(asked: Any, serve_host: str, allowed: Sequence[str] = (), field: str = "host", *,
               keyed: bool = False) -> str:
    """Where ``/init_communicator/`` may open the group's store: loopback, the server's own ``serve.host`` (the
    wildcard swift's client sends means that one), or an address the operator listed in ``serve.weight_sync_hosts``.
    A store on a wildcard address (a ``serve.host`` of ``0.0.0.0``) listens on every interface: only a server with an
    API key (``keyed``) opens one there.

    >>> store_host("0.0.0.0", "127.0.0.1"), store_host("::1", "10.0.0.5"), store_host("127.0.0.2", "::1")
    ('127.0.0.1', '::1', '127.0.0.2')
    >>> store_host("203.0.113.9", "127.0.0.1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: host is not loopback, this server's address (127.0.0.1) or a listed one: ...
    >>> store_host("127.evil.example", "127.0.0.1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: host is not loopback, this server's address (127.0.0.1) or a listed one: ...
    >>> store_host("0.0.0.0", "0.0.0.0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: host would open the group's store on every interface of a server without an API key...
    """
    if not isinstance(asked, str):
        raise RequestError(field, asked, "must be a host name or address", fix="e.g. 127.0.0.1")
    address = serve_host if asked in WIDE_OPEN else asked
    if address in WIDE_OPEN and not keyed:
        raise RequestError(field, asked, "would open the group's store on every interface of a server without an "
                           "API key (serve.host is a wildcard)",
                           fix="send 127.0.0.1, or start the server with ENGINE_API_KEY (--api-key)")
    if address in WIDE_OPEN or _is_loopback(address) or address == serve_host or address in allowed:
        return address
    raise RequestError(field, asked, f"is not loopback, this server's address ({serve_host}) or a listed one: the "
                       "group's store would listen there (or be reached there)",
                       fix="send 0.0.0.0 (this server's address) or 127.0.0.1, or list the address in "
                           "serve.weight_sync_hosts")


def torch_dtype(name: str, field: str = "dtype") -> Any:
    """``"torch.float32"`` or ``"float32"`` as a torch dtype of weights, refused by name when it is none.

    >>> torch_dtype("torch.qint8")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: dtype is not a floating dtype weights are pushed in, got 'torch.qint8'. Fix: ...
    """
    import torch

    short = str(name).rsplit(".", 1)[-1]
    if short not in WEIGHT_DTYPES:
        raise RequestError(field, name, "is not a floating dtype weights are pushed in",
                           fix=f"one of {', '.join('torch.' + d for d in WEIGHT_DTYPES)}")
    return getattr(torch, short)


def check_shape(shape: Any, field: str = "shape") -> list[int]:
    """A tensor shape: a list of sizes whose product is a model tensor's size at most.

    >>> check_shape([576, 49152])
    [576, 49152]
    >>> check_shape([1e30])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: shape must be a list of integer sizes..., got [1e+30]. Fix: e.g. [576, 49152].
    """
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise RequestError(field, shape, f"must be a list of integer sizes with at most {MAX_TENSOR_ELEMENTS} "
                           "elements in all", fix="e.g. [576, 49152]")
    count = 1
    for d in shape:
        count *= d
    if count > MAX_TENSOR_ELEMENTS:
        raise RequestError(field, shape, f"must be a list of integer sizes with at most {MAX_TENSOR_ELEMENTS} "
                           "elements in all", fix="send the parameter's own shape (GET /get_model_state_keys/)")
    return list(shape)


def receive_named(communicator: Any, name: str, dtype: str, shape: Sequence[int]) -> list[tuple[str, Any]]:
    """One tensor from the learner (the group's last rank), after ``/update_named_param/``."""
    import torch

    tensor = torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=communicator.device)
    communicator.broadcast(tensor, src=communicator.learner_rank)
    communicator.group.barrier()
    return [(name, tensor)]


def receive_flattened(communicator: Any, metadatas: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """The tensors of one swift ``FlattenedTensorBucket`` (a uint8 buffer, cut by ``metadatas``)."""
    import torch

    buffer = torch.empty(int(metadatas[-1]["end_idx"]), dtype=torch.uint8, device=communicator.device)
    communicator.broadcast(buffer, src=communicator.learner_rank)
    communicator.group.barrier()
    return unflatten(buffer, metadatas)


def receive_listed(communicator: Any, announced: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The listed tensors, broadcast one after another from the trainer (or packed, through vLLM's own consumer,
    when the group was opened ``packed`` on ``nccl``)."""
    import torch

    tensors = announced["tensors"]
    src = communicator.learner_rank
    if getattr(communicator, "packed", None):
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        received: list[tuple[str, Any]] = []
        extra = {k: v for k, v in (("buffer_size_bytes", communicator.packed.get("buffer_bytes")),
                                   ("num_buffers", communicator.packed.get("buffers"))) if v is not None}
        packed_nccl_broadcast_consumer(
            iterator=iter([(t["name"], (t["shape"], torch_dtype(t["dtype"]))) for t in tensors]),
            group=communicator, src=src, post_unpack_func=received.extend, device=communicator.device, **extra)
        return received
    out = []
    for t in tensors:
        tensor = torch.empty(tuple(t["shape"]), dtype=torch_dtype(t["dtype"]), device=communicator.device)
        communicator.broadcast(tensor, src=src)
        out.append((t["name"], tensor))
    communicator.group.barrier()
    return out


def unflatten(buffer: Any, metadatas: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """(name, tensor) pairs cut from a flattened uint8 ``buffer`` by swift's metadata (name, shape, dtype,
    start_idx, end_idx).

    >>> import torch
    >>> a, b = torch.arange(3, dtype=torch.float32), torch.ones(2, 2, dtype=torch.float16)
    >>> buffer = torch.cat([a.view(torch.uint8), b.flatten().view(torch.uint8)])
    >>> metas = [{"name": "a", "shape": [3], "dtype": "torch.float32", "start_idx": 0, "end_idx": 12},
    ...          {"name": "b", "shape": [2, 2], "dtype": "torch.float16", "start_idx": 12, "end_idx": 20}]
    >>> [(n, t.tolist()) for n, t in unflatten(buffer, metas)]
    [('a', [0.0, 1.0, 2.0]), ('b', [[1.0, 1.0], [1.0, 1.0]])]
    """
    out = []
    for meta in metadatas:
        piece = buffer[int(meta["start_idx"]):int(meta["end_idx"])]
        out.append((str(meta["name"]), piece.view(torch_dtype(meta["dtype"])).reshape(tuple(meta["shape"]))))
    return out


def check_metadatas(metadatas: Any) -> list[dict[str, Any]]:
    """A ``/update_flattened_params/`` metadata list: contiguous, non-empty byte ranges in order."""
    if not isinstance(metadatas, list) or not metadatas:
        raise RequestError("metadatas", metadatas, "must be a non-empty list", fix="send swift's bucket metadata")
    end = 0
    for i, meta in enumerate(metadatas):
        if not isinstance(meta, Mapping) or not {"name", "shape", "dtype", "start_idx", "end_idx"} <= set(meta):
            raise RequestError(f"metadatas[{i}]", meta, "must hold name, shape, dtype, start_idx and end_idx",
                               fix="send swift's FlattenedTensorMetadata fields")
        if not isinstance(meta["name"], str) or not meta["name"]:
            raise RequestError(f"metadatas[{i}].name", meta["name"], "must be a parameter name",
                               fix="e.g. model.norm.weight")
        shape = check_shape(meta["shape"], f"metadatas[{i}].shape")
        dtype = torch_dtype(meta["dtype"], f"metadatas[{i}].dtype")
        for key in ("start_idx", "end_idx"):
            if isinstance(meta[key], bool) or not isinstance(meta[key], int):
                raise RequestError(f"metadatas[{i}].{key}", meta[key], "must be an integer byte offset",
                                   fix="send the bucket's metadata unchanged")
        if meta["start_idx"] != end or meta["end_idx"] <= meta["start_idx"]:
            raise RequestError(f"metadatas[{i}].start_idx", meta["start_idx"], f"must be {end}, the previous end, "
                               "with end_idx after it", fix="send the bucket's metadata unchanged")
        count = 1
        for d in shape:
            count *= d
        size = count * dtype.itemsize
        if meta["end_idx"] - meta["start_idx"] != size:
            raise RequestError(f"metadatas[{i}].end_idx", meta["end_idx"], f"must be start_idx + {size} (the bytes "
                               f"of shape {shape} in {meta['dtype']})", fix="send the bucket's metadata unchanged")
        end = meta["end_idx"]
    return [dict(m) for m in metadatas]


MAX_ADAPTER_TENSORS = 100_000
"""Most tensors one adapter push may list (a LoRA adapter of every projection of a 100-layer model has ~1,400)."""


def check_listed(items: Any, field: str = "lora_tensors_metadata") -> dict[str, Any]:
    """swift's ``/update_adapter_param/`` list (one ``{name, dtype, shape, ...}`` per tensor, broadcast one after
    another in that order) as the announced push the backends receive: ``{"tensors": [{name, dtype, shape}, ...]}``.

    >>> check_listed([{"name": "a.lora_A.weight", "dtype": "torch.float32", "shape": [8, 64], "numel": 512}])
    {'tensors': [{'name': 'a.lora_A.weight', 'dtype': 'torch.float32', 'shape': [8, 64]}]}
    """
    if not isinstance(items, list) or not items or len(items) > MAX_ADAPTER_TENSORS:
        raise RequestError(field, items, f"must be a non-empty list of at most {MAX_ADAPTER_TENSORS} tensors",
                           fix="send swift's metadata of each adapter tensor, in broadcast order")
    tensors = []
    for i, meta in enumerate(items):
        if not isinstance(meta, Mapping) or not {"name", "shape", "dtype"} <= set(meta):
            raise RequestError(f"{field}[{i}]", meta, "must hold name, shape and dtype",
                               fix="send swift's TensorMetadata fields")
        if not isinstance(meta["name"], str) or not meta["name"]:
            raise RequestError(f"{field}[{i}].name", meta["name"], "must be a parameter name",
                               fix="e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        torch_dtype(meta["dtype"], f"{field}[{i}].dtype")
        tensors.append({"name": meta["name"], "dtype": str(meta["dtype"]),
                        "shape": check_shape(list(meta["shape"]) if isinstance(meta["shape"], tuple)
                                             else meta["shape"], f"{field}[{i}].shape")})
    return {"tensors": tensors}


class LearnerClient:
    """What the learner's halves share (:class:`WeightSyncClient`, swift's routes; ``engine.weights.transfer.
    WeightTransferClient``, vLLM's): the server's address, the transport, the group's address, the HTTP client, and a
    ``with`` block that opens the group and closes it."""

    def __init__(self, base_url: str, *, api_key: str | None = None, transport: str | None = None,
                 host: str = "127.0.0.1", port: int | None = None, timeout: float = 300.0) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.transport = check_transport(transport)
        self.host, self.port = host, port
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self._http = httpx.Client(timeout=timeout, headers=headers)
        self.communicator: Any = None

    def __enter__(self) -> Any:
        self.init_communicator()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_communicator()
        self._http.close()

    def init_communicator(self) -> None:
        raise NotImplementedError

    def close_communicator(self) -> None:
        raise NotImplementedError


class WeightSyncClient(LearnerClient):
    """The learner's half, over the routes swift's ``VLLMClient`` calls and with the same method names, so a
    training loop written for it runs unchanged; also on a CPU host (``transport="tcp"``), where swift's client
    cannot (it needs NCCL and CUDA).

    Example (a server running; ``model`` the learner's torch module)::

        with WeightSyncClient(server.url, api_key=key) as sync:
            for name, param in model.named_parameters():
                sync.update_named_param(name, param.data)
            sync.reset_prefix_cache()
    """

    def _call(self, method: str, route: str, **kwargs: Any) -> Any:
        response = self._http.request(method, f"{self.base_url}{route}", **kwargs)
        if response.status_code != 200:
            raise RequestError(route, response.status_code, f"was refused: {response.text[:500]}",
                               fix="see the server's message")
        return response.json()

    def init_communicator(self) -> None:
        """Open the group: the server's workers are ranks 0..n-1, this learner rank n."""
        import socket

        workers = int(self._call("GET", "/get_world_size/")["world_size"])
        if self.port is None:
            with socket.socket() as probe:
                probe.bind((self.host, 0))
                self.port = probe.getsockname()[1]
        opened = self._call("POST", "/init_communicator/", json={
            "host": self.host, "port": self.port, "world_size": workers + 1, "transport": self.transport})
        device = None
        if self.transport == "nccl":  # the learner's current card, as swift's client uses its own
            import torch

            device = torch.device("cuda", torch.cuda.current_device())
        self.communicator = open_communicator(self.host, self.port, workers, workers + 1, self.transport,
                                              device=device, secret=opened.get("group_secret"))

    def _send(self, tensor: Any) -> None:
        tensor = tensor.detach().to(self.communicator.device).contiguous()  # NCCL sends from its own card
        self.communicator.broadcast(tensor, src=self.communicator.rank)
        self.communicator.group.barrier()

    def update_named_param(self, name: str, weights: Any) -> None:
        self._call("POST", "/update_named_param/", json={"name": name, "dtype": str(weights.dtype),
                                                         "shape": list(weights.shape)})
        self._send(weights)

    def update_flattened_params(self, metadatas: Sequence[Any], flattened_tensor: Any) -> None:
        """One bucket: ``metadatas`` as swift builds them (``FlattenedTensorMetadata`` or dicts) and its buffer."""
        self._call("POST", "/update_flattened_params/", json={"metadatas": _metadata_dicts(metadatas)})
        self._send(flattened_tensor)

    def update_adapter_flattened_param(self, peft_config: Any, metadatas: Sequence[Any],
                                       flattened_tensor: Any) -> None:
        """A LoRA adapter alone, as one bucket (swift's trainer with ``vllm_enable_lora``): ``peft_config`` a
        ``peft.LoraConfig`` or its dict; the server loads it as adapter ``swift_lora``."""
        self._call("POST", "/update_adapter_flattened_param/", json={
            "peft_config": _config_dict(peft_config), "metadatas": _metadata_dicts(metadatas)})
        self._send(flattened_tensor)

    def update_adapter_param(self, peft_config: Any, lora_params: Mapping[str, Any]) -> None:
        """A LoRA adapter alone, one broadcast per tensor then one barrier (swift's unflattened form)."""
        metadata = [{"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "numel": t.numel()}
                    for name, t in lora_params.items()]
        self._call("POST", "/update_adapter_param/", json={"peft_config": _config_dict(peft_config),
                                                             "lora_tensors_metadata": metadata})
        for tensor in lora_params.values():
            self.communicator.broadcast(tensor.detach().to(self.communicator.device).contiguous(),
                                        src=self.communicator.rank)
        self.communicator.group.barrier()

    def reset_prefix_cache(self) -> None:
        self._call("POST", "/reset_prefix_cache/")

    def get_model_state_keys(self) -> list[str]:
        return list(self._call("GET", "/get_model_state_keys/")["keys"])

    def close_communicator(self) -> None:
        if self.communicator is not None:
            self._call("POST", "/close_communicator/")
            self.communicator = None


def _metadata_dicts(metadatas: Sequence[Any]) -> list[dict[str, Any]]:
    """swift's ``FlattenedTensorMetadata`` (or dicts) as JSON objects."""
    dumped = [m.model_dump() if hasattr(m, "model_dump") else dict(m) for m in metadatas]
    return [{**m, "shape": list(m["shape"])} for m in dumped]


def _config_dict(config: Any) -> dict[str, Any]:
    """A ``peft.LoraConfig`` (or a dict) as JSON: sets become sorted lists, enums their values."""
    import dataclasses
    import enum

    raw = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    plain: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, (set, frozenset)):
            value = sorted(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        plain[key] = value
    return plain
