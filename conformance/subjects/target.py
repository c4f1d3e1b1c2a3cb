"""A server as the suite's subject: any OpenAI-compatible server (stock ``vllm serve``, llama.cpp's server, ours),
reached through ``/v1/completions`` with text prompts by the official ``openai`` client, and checked against the
in-process HF reference on the same model (``conformance/test_target.py``).

``pytest --pyargs conformance --engine-target-url http://127.0.0.1:8000 --engine-target-model NAME`` checks it;
``--engine-model`` must be the HF folder of the model it serves. Text prompts are the common ground (llama.cpp's
server takes no token ids): each side tokenizes the same text, as is, no special tokens added.

Where an external target answers otherwise than the reference, the check ends with the verdict ``differs`` (pytest
prints it as xfailed, with the finding): a server being different is a result about that server, not a failure of
the suite. ``--engine-target-strict`` makes it a failure. Our own servers, checked the same way when no URL is given,
must never differ: there a finding fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DIFFERS = "differs: "
"""The prefix of a ``differs`` finding's reason (the report reads the verdict from it:
``conformance/kit/report.py``)."""
TARGET = "target"
"""The subject name of an external target in node ids and reports."""


@dataclass(frozen=True)
class TargetOptions:
    """What ``--engine-target-*`` said; ``url`` None: no external target (the suite's own servers are the subjects).

    >>> TargetOptions.of(url="http://127.0.0.1:8000/", model="m", key=None, extra_body='{"repeat_penalty": 1.0}',
    ...                  context=None, strict=False).extra_body
    {'repeat_penalty': 1.0}
    """

    url: str | None = None
    model: str | None = None
    key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    context: int | None = None
    strict: bool = False

    @classmethod
    def of(cls, *, url: str | None, model: str | None, key: str | None, extra_body: str | None,
           context: int | None, strict: bool) -> TargetOptions:
        """Checked options: a typed error (the option, the value, the fix) before anything starts."""
        extra: Any = {}
        if extra_body:
            try:
                extra = json.loads(extra_body)
            except json.JSONDecodeError as err:
                raise ValueError(f"--engine-target-extra-body: {extra_body!r} is not JSON ({err.msg}); fix: a JSON "
                                 "object, e.g. '{\"repeat_penalty\": 1.0}'") from None
            if not isinstance(extra, dict):
                raise ValueError(f"--engine-target-extra-body: {extra_body!r} is not a JSON object; fix: e.g. "
                                 "'{\"repeat_penalty\": 1.0}'")
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine-target-url: {url!r} is not an http(s) URL; fix: the server's base URL, "
                             "e.g. http://127.0.0.1:8000 (without /v1)")
        if url is None and (model or key or extra or context or strict):
            raise ValueError("--engine-target-model/-key/-extra-body/-context/-strict need --engine-target-url; fix: "
                             "give the server's URL, or drop them")
        if context is not None and context < 8:
            raise ValueError(f"--engine-target-context: {context} is too small; fix: the server's context length in "
                             "tokens (vllm serve: --max-model-len; llama.cpp's server: --n_ctx)")
        return cls(url=url.rstrip("/").removesuffix("/v1") if url else None, model=model, key=key,
                   extra_body=extra, context=context, strict=strict)


@dataclass(frozen=True)
class Completion:
    """One choice of a ``/v1/completions`` answer: its text, finish reason, token pieces and their log-probabilities
    (when asked for), and the usage counts."""

    text: str
    finish_reason: str | None
    tokens: list[str] | None
    token_logprobs: list[float] | None
    top_logprobs: list[dict[str, float]] | None
    prompt_tokens: int
    completion_tokens: int


class Target:
    """An OpenAI-compatible server under check, through the official ``openai`` client.

    >>> t = Target("http://127.0.0.1:9", model="m", extra_body={"repeat_penalty": 1.0})
    >>> t.body({"max_tokens": 4}, plain=False)
    {'repeat_penalty': 1.0, 'max_tokens': 4}
    >>> t.body({"max_tokens": 4}, plain=True)
    {'max_tokens': 4}
    """

    def __init__(self, url: str, *, model: str | None = None, key: str | None = None,
                 extra_body: dict[str, Any] | None = None, context: int | None = None, name: str = TARGET) -> None:
        self.url, self.key, self.name = url, key, name
        self.extra_body = dict(extra_body or {})
        self._model, self._context = model, context
        self._client: Any = None
        self._listed: dict[str, Any] | None = None

    @property
    def client(self) -> Any:
        if self._client is None:
            import openai

            self._client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key or "unused", max_retries=0,
                                         timeout=300)
        return self._client

    def listed(self) -> dict[str, Any]:
        """The model's entry in ``/v1/models`` (the one named by ``--engine-target-model``, else the first)."""
        if self._listed is None:
            entries = [m.model_dump() for m in self.client.models.list().data]
            if not entries:
                raise RuntimeError(f"{self.url}/v1/models lists no model")
            named = [m for m in entries if m.get("id") == self._model]
            if self._model and not named:
                raise RuntimeError(f"--engine-target-model {self._model!r} is not among the served models "
                                   f"{[m.get('id') for m in entries]}; fix: name one of them")
            self._listed = (named or entries)[0]
        return self._listed

    @property
    def model(self) -> str:
        return self._model or str(self.listed()["id"])

    def context_length(self) -> int | None:
        """The context length: ``--engine-target-context``, else ``max_model_len`` of ``/v1/models`` (vLLM's and ours
        list it), else None."""
        if self._context is not None:
            return self._context
        value = self.listed().get("max_model_len")
        return int(value) if isinstance(value, int) else None

    def body(self, fields: dict[str, Any], *, plain: bool) -> dict[str, Any]:
        """The request's fields beyond the client's own: ``--engine-target-extra-body`` first (unless ``plain``: the
        server's defaults as a plain OpenAI client meets them), then the check's."""
        return {**({} if plain else self.extra_body), **fields}

    def complete(self, prompt: str, *, plain: bool = False, **fields: Any) -> Completion:
        """One text completion of ``prompt``; ``fields`` are the request's (``max_tokens``, ``temperature``,
        ``stop``, ``logprobs``, vLLM's extras such as ``min_tokens``)."""
        answer = self.client.completions.create(model=self.model, prompt=prompt,
                                                extra_body=self.body(fields, plain=plain))
        choice = answer.choices[0]
        lp = choice.logprobs
        usage = answer.usage
        return Completion(text=choice.text, finish_reason=choice.finish_reason,
                          tokens=list(lp.tokens) if lp and lp.tokens is not None else None,
                          token_logprobs=list(lp.token_logprobs) if lp and lp.token_logprobs is not None else None,
                          top_logprobs=[dict(t or {}) for t in lp.top_logprobs] if lp and lp.top_logprobs else None,
                          prompt_tokens=usage.prompt_tokens if usage else -1,
                          completion_tokens=usage.completion_tokens if usage else -1)

    def stream(self, prompt: str, **fields: Any) -> tuple[str, str | None]:
        """The streamed answer to ``prompt``: its text joined from the chunks, and the last finish reason."""
        text, reason = [], None
        for chunk in self.client.completions.create(model=self.model, prompt=prompt, stream=True,
                                                    extra_body=self.body(fields, plain=False)):
            for choice in chunk.choices:
                text.append(choice.text or "")
                reason = choice.finish_reason or reason
        return "".join(text), reason

    def refused(self, body: dict[str, Any]) -> tuple[int, Any]:
        """POST ``body`` to ``/v1/completions`` as is (no client-side checks) and return (status, parsed JSON or
        the text)."""
        import httpx

        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        response = httpx.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=120)
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, response.text

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class Findings:
    """Where a target answered otherwise than the reference, collected through one check and settled at its end:
    nothing found passes; otherwise ``differs`` (xfailed with the findings) for an external target, a failure for our
    own servers or under ``--engine-target-strict``.

    >>> f = Findings(strict=True)
    >>> f.differ("greedy text of p1 at token 3: ' a' vs ' b'")
    >>> f.found
    ["greedy text of p1 at token 3: ' a' vs ' b'"]
    """

    def __init__(self, *, strict: bool) -> None:
        self.strict = strict
        self.found: list[str] = []

    def differ(self, finding: str) -> None:
        self.found.append(finding)

    def settle(self) -> None:
        import pytest

        if not self.found:
            return
        text = "; ".join(self.found)
        if self.strict:
            pytest.fail(f"the server differs from the HF reference: {text}", pytrace=False)
        pytest.xfail(DIFFERS + text)


def error_shape_problem(status: int, body: Any) -> str | None:
    """What is wrong with a refusal by the OpenAI API's shape (a 4xx status and ``{"error": {"message": ...}}``),
    or None.

    >>> error_shape_problem(400, {"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError"}})
    >>> error_shape_problem(422, {"detail": [{"msg": "bad"}]})
    "answered 422 with {'detail': [{'msg': 'bad'}]} (no 'error' object with a 'message')"
    >>> error_shape_problem(200, {"choices": []})
    'answered 200: accepted'
    """
    if 200 <= status < 300:
        return f"answered {status}: accepted"
    if not 400 <= status < 500:
        return f"answered {status} (not a 4xx): {str(body)[:200]}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error["message"]:
        return f"answered {status} with {str(body)[:200]} (no 'error' object with a 'message')"
    return None
