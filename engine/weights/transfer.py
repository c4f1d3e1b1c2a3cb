"""Weight updates as vLLM's own routes take them (TRL 1.16's ``VLLMClient``, SkyRL, verl's remote servers):
``/init_weight_transfer_engine`` (the trainer's group: it is rank 0 and hosts the store, the server's workers
follow at ``rank_offset``), then per training step ``/start_weight_update``, one or more ``/update_weights`` (the
tensors listed by ``names``, ``dtype_names`` and ``shapes``, broadcast one after another in that order), and
``/finish_weight_update``. The group is :mod:`engine.weights.sync`'s: the ``tcp`` transport on CPU hosts, ``nccl``
(vLLM's ``PyNcclCommunicator``; packed broadcasts through vLLM's own consumer) where CUDA is.

This module holds what differs from swift's protocol: the checks of ``init_info`` and ``update_info`` and the
trainer's half (:class:`WeightTransferClient`); the receive of listed tensors is ``engine.weights.sync.receive_listed``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from engine.errors import RequestError
from engine.weights.sync import LearnerClient, check_shape, check_transport, open_communicator, torch_dtype

MAX_LISTED = 100_000
"""Most tensors one ``/update_weights`` may list (a 70B model has about 800)."""


def check_init_info(info: Mapping[str, Any], workers: int) -> dict[str, Any]:
    """``init_info`` of ``/init_weight_transfer_engine``, as this server can join it: the trainer is the one rank
    before the workers (``rank_offset`` 1, ``world_size`` workers + 1); ``transport`` (this server's extension)
    names how tensors move; ``packed`` broadcasts exist only on ``nccl``.

    >>> check_init_info({"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
    ...                  "transport": "tcp"}, workers=1)["transport"]
    'tcp'
    >>> check_init_info({"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
    ...                  "transport": "tcp"}, workers=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: init_info.world_size must be 2: ...
    """
    for key, low, high in (("master_port", 1, 65535), ("rank_offset", 0, None), ("world_size", 1, None)):
        value = info.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
            raise RequestError(f"init_info.{key}", value, "must be a positive integer" + (
                f" up to {high}" if high else ""), fix="send what the trainer's group uses")
    if info.get("nccl_unique_id_b64") is not None:
        raise RequestError("init_info.nccl_unique_id_b64", "<given>", "is not supported by this server: its "
                           "workers join over the trainer's TCP store", fix="send master_address and master_port")
    if info["rank_offset"] != 1:
        raise RequestError("init_info.rank_offset", info["rank_offset"], "must be 1: one trainer rank (0) before "
                           "this server's workers", fix="send rank_offset 1")
    if info["world_size"] != workers + 1:
        raise RequestError("init_info.world_size", info["world_size"], f"must be {workers + 1}: this server's "
                           f"{workers} workers and the trainer", fix="take it from GET /get_world_size, plus one")
    transport = check_transport(info.get("transport"))
    packed = info.get("packed")
    if packed is not None and not isinstance(packed, bool):
        raise RequestError("init_info.packed", packed, "must be true or false", fix="leave it out")
    if packed and transport != "nccl":
        raise RequestError("init_info.packed", packed, f"packed broadcasts are NCCL's; this group moves tensors "
                           f"over {transport}", fix="leave packed out (or false) with the tcp transport")
    for key in ("packed_buffer_size_bytes", "packed_num_buffers"):
        value = info.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RequestError(f"init_info.{key}", value, "must be a positive integer", fix="leave it out")
        if value is not None and not packed:
            raise RequestError(f"init_info.{key}", value, "applies only to packed broadcasts",
                               fix="leave it out, or send packed true on nccl")
    return {"transport": transport, "packed": bool(packed),
            "buffer_bytes": info.get("packed_buffer_size_bytes"), "buffers": info.get("packed_num_buffers")}


def check_update_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """``update_info`` of ``/update_weights`` as the announced push the backends load: ``{"tensors": [{name, dtype,
    shape}, ...]}``, the three lists of equal length, every dtype and shape valid.

    >>> check_update_info({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 3]]})
    {'tensors': [{'name': 'w', 'dtype': 'float32', 'shape': [2, 3]}]}
    >>> check_update_info({"names": ["w"], "dtype_names": [], "shapes": [[2]]})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: update_info.dtype_names must list one dtype per name (1), got []. Fix: ...
    """
    names = info.get("names")
    if not isinstance(names, list) or not names or len(names) > MAX_LISTED:
        raise RequestError("update_info.names", names, f"must be a non-empty list of at most {MAX_LISTED} "
                           "parameter names", fix="list the tensors this update broadcasts, in order")
    for key, what in (("dtype_names", "dtype"), ("shapes", "shape")):
        value = info.get(key)
        if not isinstance(value, list) or len(value) != len(names):
            raise RequestError(f"update_info.{key}", value, f"must list one {what} per name ({len(names)})",
                               fix="send the three lists in the same order")
    packed = info.get("packed")
    if packed:  # vLLM's older clients put it here; this server reads it from the init call
        raise RequestError("update_info.packed", packed, "is set once, in init_info (and only on nccl)",
                           fix="leave it out of update_info")
    unknown = set(info) - {"names", "dtype_names", "shapes", "packed"}
    if unknown:
        key = sorted(unknown)[0]
        raise RequestError(f"update_info.{key}", info[key], "is not a field this server reads",
                           fix="send names, dtype_names and shapes")
    tensors = []
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise RequestError(f"update_info.names[{i}]", name, "must be a parameter name", fix="e.g. lm_head.weight")
        torch_dtype(info["dtype_names"][i], f"update_info.dtype_names[{i}]")
        tensors.append({"name": name, "dtype": str(info["dtype_names"][i]),
                        "shape": check_shape(info["shapes"][i], f"update_info.shapes[{i}]")})
    return {"tensors": tensors}


class WeightTransferClient(LearnerClient):
    """The trainer's half of vLLM's weight-transfer routes, with the method names of TRL 1.16's ``VLLMClient``
    (``init_communicator``, ``weight_update``, ``update_named_param(s)``, ``update_model_params``,
    ``reset_prefix_cache``, ``close_communicator``), so a loop written for it runs unchanged; on a CPU host too
    (``transport="tcp"``), where TRL's client cannot (it needs NCCL and CUDA).

    Example (a server running; ``model`` the trainer's torch module)::

        with WeightTransferClient(server.url, transport="tcp") as client:
            client.update_model_params(model)
            client.reset_prefix_cache()
    """

    _updating = False

    def _post(self, route: str, body: dict[str, Any] | None = None) -> Any:
        response = self._http.post(f"{self.base_url}{route}", json=body if body is not None else {})
        if response.status_code != 200:
            raise RequestError(route, response.status_code, f"was refused: {response.text[:500]}",
                               fix="see the server's message")
        return response.json()

    def init_communicator(self) -> None:
        """Open the group as its rank 0 (this process hosts the store); the server's workers join after it."""
        import socket

        workers = int(self._http.get(f"{self.base_url}/get_world_size").json()["world_size"])
        if self.port is None:
            with socket.socket() as probe:
                probe.bind((self.host, 0))
                self.port = probe.getsockname()[1]
        opened = self._post("/init_weight_transfer_engine", {"init_info": {
            "master_address": self.host, "master_port": self.port, "rank_offset": 1, "world_size": workers + 1,
            "transport": self.transport}})
        device = None
        if self.transport == "nccl":
            import torch

            device = torch.device("cuda", torch.cuda.current_device())
        self.communicator = open_communicator(self.host, self.port, 0, workers + 1, self.transport, device=device,
                                              learner_rank=0, secret=opened.get("group_secret"))

    @contextmanager
    def weight_update(self) -> Iterator[None]:
        """One training step's update: the server holds new generations from start to finish."""
        self._post("/start_weight_update")
        self._updating = True
        try:
            yield
        finally:
            self._updating = False
            self._post("/finish_weight_update")

    def update_named_param(self, name: str, weights: Any) -> None:
        self.update_named_params([(name, str(weights.dtype).removeprefix("torch."), list(weights.shape))],
                                 iter([(name, weights)]))

    def update_named_params(self, metadata: Sequence[tuple[str, str, list[int]]],
                            named_params: Iterable[tuple[str, Any]]) -> None:
        """Announce ``metadata`` (name, dtype, shape per tensor), then broadcast the tensors in that order (the
        server answers once it has loaded them)."""
        from concurrent.futures import ThreadPoolExecutor

        names, dtypes, shapes = (list(column) for column in zip(*metadata, strict=True))
        if not self._updating:
            self._post("/start_weight_update")
        with ThreadPoolExecutor(1) as pool:  # the server receives while answering: the call runs beside the sends
            answer = pool.submit(self._post, "/update_weights", {"update_info": {
                "names": names, "dtype_names": dtypes, "shapes": shapes}})
            for _, tensor in named_params:
                self.communicator.broadcast(tensor.detach().to(self.communicator.device).contiguous(), src=0)
            self.communicator.group.barrier()
            answer.result()
        if not self._updating:
            self._post("/finish_weight_update")

    def update_model_params(self, model: Any) -> None:
        params = list(model.named_parameters())
        self.update_named_params([(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in params],
                                 ((n, p.data) for n, p in params))

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")

    def close_communicator(self) -> None:
        if self.communicator is not None:
            self._post("/shutdown_weight_transfer_engine")
            self.communicator = None
