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
    group's TCP store, on the CPU.

    >>> import torch
    >>> class Store:  # one process plays both ranks of a group here
    ...     def __init__(self): self.sent = {}
    ...     def broadcast_obj(self, obj, src): return self.sent.setdefault(src, obj)
    >>> group = Store()
    >>> learner, worker = TcpCommunicator(group, rank=1), TcpCommunicator(group, rank=0)
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
        if self.rank == src:
            self.group.broadcast_obj(tensor.detach().to("cpu").contiguous(), src=src)
        else:
            tensor.copy_(self.group.broadcast_obj(None, src=src))


def check_transport(transport: Any) -> str:
    """The transport a request names (None: this host's default), refused by name when unknown."""
    if transport is None:
        from engine.backends.host import has_cuda

        return "nccl" if has_cuda() else "tcp"
    if transport not in TRANSPORTS:
        raise RequestError("transport", transport, f"must be one of {', '.join(TRANSPORTS)}",
                           fix="leave it out for this host's default (nccl with CUDA, tcp without)")
    return str(transport)


def open_communicator(host: str, port: int, rank: int, world_size: int, transport: str, device: Any = None) -> Any:
    """Join the learner's group as ``rank`` (rank 0 hosts its TCP store on ``host:port``) with ``transport``."""
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    if transport == "nccl":
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        return PyNcclCommunicator(group, device=device)
    return TcpCommunicator(group)


def torch_dtype(name: str) -> Any:
    """``"torch.float32"`` or ``"float32"`` as a torch dtype, refused by name when it is none."""
    import torch

    dtype = getattr(torch, str(name).rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise RequestError("dtype", name, "is not a torch dtype", fix='e.g. "torch.float32"')
    return dtype


def receive_named(communicator: Any, name: str, dtype: str, shape: Sequence[int]) -> list[tuple[str, Any]]:
    """One tensor from the learner (the group's last rank), after ``/update_named_param/``."""
    import torch

    tensor = torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=communicator.device)
    communicator.broadcast(tensor, src=communicator.group.world_size - 1)
    communicator.group.barrier()
    return [(name, tensor)]


def receive_flattened(communicator: Any, metadatas: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """The tensors of one swift ``FlattenedTensorBucket`` (a uint8 buffer, cut by ``metadatas``)."""
    import torch

    buffer = torch.empty(int(metadatas[-1]["end_idx"]), dtype=torch.uint8, device=communicator.device)
    communicator.broadcast(buffer, src=communicator.group.world_size - 1)
    communicator.group.barrier()
    return unflatten(buffer, metadatas)


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
        if meta["start_idx"] != end or meta["end_idx"] <= meta["start_idx"]:
            raise RequestError(f"metadatas[{i}].start_idx", meta["start_idx"], f"must be {end}, the previous end, "
                               "with end_idx after it", fix="send the bucket's metadata unchanged")
        torch_dtype(meta["dtype"])
        end = meta["end_idx"]
    return [dict(m) for m in metadatas]


class WeightSyncClient:
    """The learner's half, over the routes swift's ``VLLMClient`` calls and with the same method names, so a
    training loop written for it runs unchanged; also on a CPU host (``transport="tcp"``), where swift's client
    cannot (it needs NCCL and CUDA).

    Example (a server running; ``model`` the learner's torch module)::

        with WeightSyncClient(server.url, api_key=key) as sync:
            for name, param in model.named_parameters():
                sync.update_named_param(name, param.data)
            sync.reset_prefix_cache()
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, transport: str | None = None,
                 host: str = "127.0.0.1", port: int | None = None, timeout: float = 300.0) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.transport = check_transport(transport)
        self.host, self.port = host, port
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self._http = httpx.Client(timeout=timeout, headers=headers)
        self.communicator: Any = None

    def __enter__(self) -> WeightSyncClient:
        self.init_communicator()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_communicator()
        self._http.close()

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
        self._call("POST", "/init_communicator/", json={"host": self.host, "port": self.port,
                                                        "world_size": workers + 1, "transport": self.transport})
        device = None
        if self.transport == "nccl":  # the learner's current card, as swift's client uses its own
            import torch

            device = torch.device("cuda", torch.cuda.current_device())
        self.communicator = open_communicator(self.host, self.port, workers, workers + 1, self.transport,
                                              device=device)

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
        dumped = [m.model_dump() if hasattr(m, "model_dump") else dict(m) for m in metadatas]
        self._call("POST", "/update_flattened_params/", json={"metadatas": [
            {**m, "shape": list(m["shape"])} for m in dumped]})
        self._send(flattened_tensor)

    def reset_prefix_cache(self) -> None:
        self._call("POST", "/reset_prefix_cache/")

    def get_model_state_keys(self) -> list[str]:
        return list(self._call("GET", "/get_model_state_keys/")["keys"])

    def close_communicator(self) -> None:
        if self.communicator is not None:
            self._call("POST", "/close_communicator/")
            self.communicator = None
