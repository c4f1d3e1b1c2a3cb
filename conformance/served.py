"""``--engine-served``: every engine a check asks the pool for is reached through ``python -m engine.serve``.

A :class:`ServedTwin` stands in for the in-process engine: ``generate`` runs the call in-process *and* through the
server (``/infer/`` with the engine extension for options, stop policy and plugins), asserts the two agree field
by field (trigger flags from the envelope against the in-process meta included), and hands the check the served
results. Everything else (tokenizer, config, backend) is the in-process engine's. A call the engine refuses must
be refused by the server too (HTTP 400). Plugins given as Python objects cannot travel over HTTP: such calls run
in-process only and are counted in ``local_only``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from conformance.compare import assert_same_results, assert_served_equal
from engine.errors import EngineError


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


class ServedTwin:
    """The in-process engine plus its served twin (see the module doc)."""

    def __init__(self, local: Any, server: Callable[[], Any]) -> None:
        self.local = local
        self._server = server
        self.served_calls = 0
        self.local_only = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def generate(self, requests: Any, *, options: Any = None, stop: Any = None, plugins: Any = None) -> Any:
        from engine.client import RolloutClient, RolloutServerError

        extension = {k: _plain(v) for k, v in (("options", options), ("stop", stop), ("plugins", plugins))
                     if v is not None}
        if not _jsonable(extension):
            self.local_only += 1
            return self.local.generate(requests, options=options, stop=stop, plugins=plugins)
        client = RolloutClient(self._server().url, repeat_terminate=self.local.config.repeat_terminate,
                               batch_size=10_000, health_timeout=30)
        with client:
            try:
                local = self.local.generate(requests, options=options, stop=stop, plugins=plugins)
            except EngineError as err:
                try:
                    client.infer(requests, engine=extension)
                except RolloutServerError as served_err:
                    assert "answered 400" in str(served_err), f"served refusal is not a 400: {served_err}"
                    raise err from None
                raise AssertionError(f"in-process refused ({err}) but the server generated") from err
            served = client.infer(requests, engine=extension)
        self.served_calls += 1
        assert_served_equal(served, local, what=f"served vs in-process ({self.local.backend.name})")
        assert_same_results({"served": served, "in-process": local}, what="served vs in-process")
        return served
