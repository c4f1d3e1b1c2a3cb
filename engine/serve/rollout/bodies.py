"""The rollout surface's request bodies (ms-swift's protocol), each field with what it is to the engine
(:mod:`engine.serve.shared.fields`): ``POST /infer/`` and swift's weight-sync calls.

A new sampling option of swift's ``RequestConfig`` is one line in :class:`RequestConfig`, or in
``shared/bodies.py::SamplingOptions`` when every surface takes it under the same name.

>>> from engine.serve.shared.fields import FieldTable
>>> FieldTable.of(InferRequest).client_field("generation.max_new_tokens")
'request_config.max_tokens'
"""

from __future__ import annotations

from typing import Annotated, Any

from engine.serve.shared.bodies import Body, EngineExtension, Message, Number, SamplingOptions
from engine.serve.shared.fields import Engine, Neutral, Wire


class RequestConfig(SamplingOptions):
    """``/infer/``'s ``request_config``: the fields swift's ``RequestConfig`` sends (the options every surface names
    alike, then swift's own)."""

    max_tokens: Annotated[int | None, Engine("generation.max_new_tokens")] = None
    logprobs: Annotated[bool | None, Wire("per-token logprobs in the answer")] = None
    top_logprobs: Annotated[int | None, Engine("generation.logprobs", read=False)] = None
    return_details: Annotated[bool | None, Wire("token ids in the answer")] = None
    num_beams: Annotated[int | None, Neutral((1,))] = None
    stream: Annotated[bool | None, Neutral((False,))] = None
    prompt_logprobs: Annotated[int | None, Neutral((None,))] = None
    n: Annotated[int | None, Neutral((1,))] = None
    best_of: Annotated[int | None, Neutral((None, 1))] = None
    presence_penalty: Annotated[Number | None, Neutral((0, 0.0))] = None
    frequency_penalty: Annotated[Number | None, Neutral((0, 0.0))] = None
    length_penalty: Annotated[Number | None, Neutral((1, 1.0))] = None
    structured_outputs_regex: Annotated[str | None, Neutral((None,))] = None


class InferItem(Body):
    """One of ``/infer/``'s ``infer_requests`` (swift's ``InferRequest``); only text chat is served."""

    messages: Annotated[list[Message], Wire("the conversation")]
    images: Annotated[list[Any] | None, Neutral(([],))] = None
    audios: Annotated[list[Any] | None, Neutral(([],))] = None
    videos: Annotated[list[Any] | None, Neutral(([],))] = None
    tools: Annotated[list[Any] | None, Neutral(([],))] = None
    objects: Annotated[dict[str, Any] | None, Neutral(({},))] = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, Neutral(({},))] = None
    data_dict: Annotated[dict[str, Any] | None, Wire("accepted and ignored (swift's own data)")] = None
    uuid: Annotated[str | None, Wire("accepted and ignored")] = None
    add_eos: Annotated[bool | None, Neutral((None,))] = None


class InferRequest(Body):
    """``POST /infer/`` (ms-swift's rollout protocol)."""

    infer_requests: Annotated[list[InferItem], Wire("the conversations")]
    request_config: Annotated[RequestConfig | None, Wire("swift's sampling settings")] = None
    metrics: Annotated[list[Any] | None, Neutral(([],))] = None
    use_tqdm: Annotated[bool | None, Wire("accepted and ignored")] = None
    adapter_request: Annotated[dict[str, Any] | None,
                               Wire("swift's AdapterRequest: {name, path} of a loaded adapter")] = None
    engine: Annotated[EngineExtension | None, Wire("the engine extension")] = None


class InitCommunicatorRequest(Body):
    """``POST /init_communicator/`` (swift's weight sync)."""

    host: Annotated[str, Wire("the learner's group address")]
    port: Annotated[int, Wire("the learner's group port")]
    world_size: Annotated[int, Wire("this server's workers and the learner")]
    transport: Annotated[str | None, Wire("how tensors move")] = None
    client_device_uuid: Annotated[str | None, Wire("accepted and ignored")] = None


class UpdateNamedParamRequest(Body):
    """``POST /update_named_param/``: one tensor announced, its data follows over the communicator."""

    name: Annotated[str, Wire("the parameter's name")]
    dtype: Annotated[str, Wire("the tensor's dtype")]
    shape: Annotated[list[int], Wire("the tensor's shape")]


class UpdateFlattenedParamsRequest(Body):
    """``POST /update_flattened_params/``: tensors announced, one flat buffer follows over the communicator."""

    metadatas: Annotated[list[dict[str, Any]], Wire("the tensors in the buffer")]


class UpdateAdapterFlattenedParamRequest(Body):
    """``POST /update_adapter_flattened_param/``: a LoRA adapter alone (swift's trainer with ``vllm_enable_lora``),
    its tensors announced with its PEFT config; one flat buffer follows over the communicator."""

    peft_config: Annotated[dict[str, Any], Wire("the adapter's LoraConfig (swift's peft_config_to_dict)")]
    metadatas: Annotated[list[dict[str, Any]], Wire("the adapter's tensors in the buffer")]
    lora_int_id: Annotated[int | None, Wire("accepted and ignored: the adapter is named swift_lora")] = None


class UpdateAdapterParamRequest(Body):
    """``POST /update_adapter_param/``: a LoRA adapter alone, one broadcast per tensor, then one barrier."""

    peft_config: Annotated[dict[str, Any], Wire("the adapter's LoraConfig (swift's peft_config_to_dict)")]
    lora_tensors_metadata: Annotated[list[dict[str, Any]], Wire("the adapter's tensors, in broadcast order")]
    lora_int_id: Annotated[int | None, Wire("accepted and ignored: the adapter is named swift_lora")] = None


class InitWeightTransferRequest(Body):
    """``POST /init_weight_transfer_engine`` (vLLM's weight transfer; TRL 1.16's ``VLLMClient``)."""

    init_info: Annotated[dict[str, Any], Wire("the trainer's group (engine.weights.transfer.check_init_info)")]


class UpdateWeightsRequest(Body):
    """``POST /update_weights``: tensors listed, broadcast by the trainer in that order."""

    update_info: Annotated[dict[str, Any], Wire("names, dtype_names and shapes of the tensors that follow")]


class FinishWeightUpdateRequest(Body):
    """``POST /finish_weight_update``: the update's weights take effect."""

    weight_version: Annotated[str | None, Wire("the version GET /weight_info reports after")] = None


class UpdateWeightsFromDiskRequest(Body):
    """``POST /update_weights_from_disk`` (SGLang's and AReaL's name): reload a saved checkpoint folder."""

    model_path: Annotated[str, Wire("the checkpoint folder, as this server sees it")]
    load_format: Annotated[str | None, Wire("auto or safetensors")] = None
    weight_version: Annotated[str | None, Wire("the version GET /weight_info reports after")] = None
    flush_cache: Annotated[bool | None, Wire("reset the prefix cache after (default true)")] = None
    abort_all_requests: Annotated[bool | None, Neutral((False,))] = None
