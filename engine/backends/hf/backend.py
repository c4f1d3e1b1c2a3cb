"""The Hugging Face transformers backend: ``model.generate`` on a left-padded batch.

The model's own ``generation_config`` is replaced by an empty one at load, and every call passes a
complete ``GenerationConfig`` built from the plan, so no checkpoint default (temperature, top_k=50,
repetition penalty, max_length) leaks in. Sampling is the backend's own last logits processor, one generator
per row (:mod:`engine.backends.hf.sampling`), so ``generate`` itself always selects greedily. A finished row keeps
being padded by ``generate``; the :class:`RowFinishRecorder` notes the step at which each row ended, so its ids
are cut exactly there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from engine.backends.base import BackendBase, BackendOutput, CallPlan, Capabilities, Prompt, TokenScores
from engine.backends.registry import SPECS
from engine.config import HfConfig, ModelConfig
from engine.errors import BackendUnavailableError, EngineError, RequestError
from engine.rules.events import stopped_on_seen_token

SPEC = SPECS["hf"]
HF_OWN = ("repetition_penalty",)
"""The fields of the call's processing (``CallPlan.processing``) HF's own ``GenerationConfig`` applies (its repetition
penalty, CTRL's rule as vLLM's); every other field is a step of the shared warp :class:`~engine.backends.hf.sampling.
RowSampler` runs (``engine.rules.processing.warp``)."""
HOOKS = SPEC.hooks


def _import_torch_transformers() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError as err:
        raise BackendUnavailableError(SPEC.name, f"{err.name} is not installed",
                                      "pip install 'xbackend-engine[hf]'") from err
    return torch, transformers


def resolve_device(device: str) -> str:
    torch, _ = _import_torch_transformers()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        from engine.errors import ConfigError

        raise ConfigError("model.device", device, "needs CUDA, which this machine lacks", fix="use device: cpu")
    return device


SCORE_TOKENS = 8192
"""Most tokens (rows x width) one scoring forward takes."""
SCORE_POSITIONS = 512
"""Positions whose full-vocabulary logits a scoring step holds at once (on a :data:`PLAIN_HEAD` model)."""
PLAIN_HEAD = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2"})
"""Model types whose logits are ``lm_head(decoder(ids).last_hidden_state)``, nothing after (no soft-capping, no
scaling): their scoring runs the head per slice of positions."""

class RowFinishRecorder:
    """A stopping criterion that ends rows on terminal ids, stop strings or stopping-criteria row rules, and
    records when each ended.

    ``lengths[row]`` is the number of generated tokens the row kept (None while it runs). ``stop_watches`` (one
    :class:`~engine.rules.stop.StopStringWatch` per row, or None) end rows on stop strings; they count only once
    more than ``min_new_tokens`` tokens exist, as in vLLM. ``rule_sets`` (one per row) are
    the rules plugged in through the "hf_stopping_criteria" hook: a row stops right after the token that
    makes its rules demand an end (no EOS appended). ``on_token(row, position, token)`` (streaming) hears every
    token a row keeps, the one that ends it included, as soon as it exists; when it returns True the row's caller
    is gone and the row ends there. ``budgets`` (one per row, or None) end a row once it has that many tokens: what
    its prompt leaves of the context (finish ``length``, as vLLM and llama.cpp end it), where a batch-wide
    ``max_new_tokens`` would let a long prompt's row run past the context.

    >>> import torch
    >>> rec = RowFinishRecorder(prompt_len=2, terminal_ids=[0])
    >>> rec(torch.tensor([[5, 5, 7], [5, 5, 0]]), None).tolist()
    [False, True]
    >>> rec.lengths
    [None, 1]
    >>> RowFinishRecorder(prompt_len=2, terminal_ids=[0], budgets=[1, 4])(torch.tensor([[5, 5, 7], [5, 5, 7]]),
    ...                                                                   None).tolist()
    [True, False]
    """

    def __init__(self, prompt_len: int, terminal_ids: Sequence[int], stop_watches: list[Any] | None = None,
                 rule_sets: list[Any] | None = None,
                 on_token: Callable[[int, int, int], bool | None] | None = None,
                 budgets: Sequence[int] | None = None):
        import torch

        self.budgets = list(budgets) if budgets is not None else None
        self.prompt_len = prompt_len
        self.terminal = torch.tensor(list(terminal_ids), dtype=torch.long)
        self.stop_watches = stop_watches
        self.rule_sets = rule_sets or []
        self.on_token = on_token
        self.lengths: list[int | None] = []

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        from engine.backends.hf.rules import feed_new_tokens

        batch, total = input_ids.shape
        if not self.lengths:
            self.lengths = [None] * batch
        step = total - self.prompt_len  # (batch, total): tokens generated so far = step
        last = input_ids[:, -1]
        done = torch.isin(last, self.terminal.to(last.device))
        if self.stop_watches:
            tokens = last.tolist()
            stopped = [self.lengths[row] is None and watch.feed(tokens[row])
                       for row, watch in enumerate(self.stop_watches)]
            done = done | torch.tensor(stopped, device=done.device)
        if self.rule_sets:
            feed_new_tokens(self.rule_sets, input_ids, self.prompt_len)
            ended = torch.tensor([rs.decision().force_eos for rs in self.rule_sets], device=done.device)
            done = done | ended
        if self.budgets is not None:
            done = done | torch.tensor([step >= b for b in self.budgets], device=done.device)
        if self.on_token is not None:
            gone = [row for row, token in enumerate(last.tolist())
                    if self.lengths[row] is None and self.on_token(row, step - 1, token)]
            if gone:  # nobody waits for these rows any more: end them now
                done = done.clone()
                done[gone] = True
        for row in torch.nonzero(done).flatten().tolist():
            if self.lengths[row] is None:
                self.lengths[row] = step
        already = torch.tensor([n is not None for n in self.lengths], device=done.device)
        return done | already


class HfBackend(BackendBase, backend="hf"):
    """Generate with ``transformers``; the correctness-first default backend.

    Usually built by ``GenerationEngine``; directly (needs a built model)::

        tokenizer, info = load_tokenizer(ModelConfig(path=".fixtures/smollm2-135m-instruct"))
        backend = HfBackend(ModelConfig(path=".fixtures/smollm2-135m-instruct"), HfConfig(), tokenizer)
    """

    streams_tokens = True
    """``generate`` takes ``on_token`` (the engine streams through it)."""

    def __init__(self, model: ModelConfig, settings: HfConfig, tokenizer: Any, processor: Any = None,
                 repeat_terminate: Any = None) -> None:
        torch, transformers = _import_torch_transformers()
        self.settings = settings
        self.tokenizer = tokenizer
        self.processor = processor
        self.device = resolve_device(model.device)
        kwargs: dict[str, Any] = {"trust_remote_code": model.trust_remote_code}
        kwargs["dtype"] = model.dtype if model.dtype == "auto" else getattr(torch, model.dtype)
        if model.attn_implementation is not None:
            kwargs["attn_implementation"] = model.attn_implementation
        auto = transformers.AutoModelForImageTextToText if processor is not None else transformers.AutoModelForCausalLM
        self.model = auto.from_pretrained(model.path, **kwargs).to(self.device).eval()
        self.model.generation_config = transformers.GenerationConfig()  # no checkpoint defaults leak in
        text_config = getattr(self.model.config, "text_config", None) or self.model.config
        lengths = [n for n in (model.max_model_len, getattr(text_config, "max_position_embeddings", None)) if n]
        self.vocab_size = int(text_config.vocab_size)
        self.peft: Any = None
        """The PEFT model holding ``model.adapters`` (injected into ``self.model``'s layers, unmerged), or None."""
        self._originals: dict[Any, Any] = {}
        """``hf.merge_adapters``: each LoRA layer's base weight as loaded, restored after every merged forward."""
        names = self._load_adapters(model)
        self.capabilities = Capabilities(name=self.name, logprobs=True, supports_vlm=processor is not None, hooks=HOOKS,
                                         max_model_len=min(lengths) if lengths else None, scoring=processor is None,
                                         rescoring=processor is None,
                                         structured_outputs=processor is None, adapters=names)
        self._schemas: Any = None

    def _load_adapters(self, model: ModelConfig) -> tuple[str, ...]:
        """Load every adapter of ``model.adapters`` with PEFT (checked first: ``engine.adapters``), unmerged; a row
        picks one per forward (:meth:`_with_adapter`)."""
        from engine.adapters import AdapterSet

        self.adapter_set = AdapterSet(model, model.path)
        for adapter in self.adapter_set.loaded.values():
            self._peft_load(adapter)
        return self.adapter_set.names

    def _peft_load(self, adapter: Any) -> None:
        """``adapter`` into the PEFT model (made on the first), replacing one of the same name."""
        if self.peft is None:
            try:
                from peft import PeftModel
            except ImportError as err:
                raise BackendUnavailableError(SPEC.name, "peft is not installed (LoRA adapters need it)",
                                              "pip install 'xbackend-engine[hf]'") from err
            self.peft = PeftModel.from_pretrained(self.model, adapter.path, adapter_name=adapter.name,
                                                  is_trainable=False)
            self.peft.eval()
            return
        if adapter.name in self.peft.peft_config:
            self.peft.delete_adapter(adapter.name)
        self.peft.load_adapter(adapter.path, adapter_name=adapter.name, is_trainable=False)

    @contextlib.contextmanager
    def _merged(self, name: str) -> Any:
        """Adapter ``name`` merged into every base weight it changes (PEFT's ``merge``), then each of those weights
        copied back from the original kept on the first merge: exact, where PEFT's ``unmerge`` subtracts and leaves
        float rounding behind."""
        from peft.tuners.lora import LoraLayer

        self.peft.set_adapter(name)
        layers = [m for m in self.model.modules() if isinstance(m, LoraLayer) and name in m.lora_A]
        for layer in layers:
            weight = layer.get_base_layer().weight
            if layer not in self._originals:
                self._originals[layer] = weight.detach().clone()
            layer.merge(adapter_names=[name])
        try:
            yield
        finally:
            for layer in layers:
                layer.get_base_layer().weight.data.copy_(self._originals[layer])
                layer.merged_adapters.clear()

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        """Load adapter ``name`` from ``path`` while serving (checked as ``model.adapters`` are); ``replace``: in
        place of the one of that name. Never during a ``generate`` (the served engine runs it on the batcher)."""
        adapter = self.adapter_set.admit(name, path, replace=replace)
        self._peft_load(adapter)
        self.adapter_set.keep(adapter)
        self.capabilities = dataclasses.replace(self.capabilities, adapters=self.adapter_set.names)

    def unload_adapter(self, name: str) -> None:
        self.adapter_set.drop(name)
        self.peft.delete_adapter(name)
        self.capabilities = dataclasses.replace(self.capabilities, adapters=self.adapter_set.names)

    def _with_adapter(self, name: str | None) -> Any:
        """A context in which ``self.model`` computes with adapter ``name`` (None: the base model, adapters off);
        with ``hf.merge_adapters``, ``name`` merged into the weights for the context (:meth:`_merged`)."""
        if name is not None and self.settings.merge_adapters:
            return self._merged(name)
        if self.peft is None or not self.peft.peft_config:  # none loaded (all unloaded): the base model as it is
            return contextlib.nullcontext()
        if name is None:
            self.peft.set_adapter(next(iter(self.peft.peft_config)))  # one that exists, then switched off
            return self.peft.disable_adapter()
        self.peft.set_adapter(name)
        return contextlib.nullcontext()

    # -- weight sync (engine.weights.sync): this process is the group's rank 0 ------------------------------------

    def open_weights(self, host: str, port: int, world_size: int, transport: str, timeout_s: float = 300.0, *,
                     learner_rank: int | None = None, packed: dict[str, Any] | None = None,
                     secret: str | None = None) -> None:
        from engine.weights.sync import Joining, open_communicator

        rank = 1 if learner_rank == 0 else 0

        def join() -> Any:
            communicator = open_communicator(host, port, rank, world_size, transport, device=self.device,
                                             timeout_s=timeout_s, learner_rank=learner_rank, secret=secret)
            communicator.packed = packed
            return communicator

        self.weights = Joining(join)

    def check_announced(self, announced: dict[str, Any]) -> None:
        """Every announced name is a parameter of the model, with its shape (any floating dtype converts)."""
        from engine.weights.sync import announced_tensors

        self._check_tensors(announced_tensors(announced))

    def _check_tensors(self, tensors: Sequence[tuple[str, str, Sequence[int]]]) -> None:
        """Against the loaded model's own state (``engine.weights.description``'s rule)."""
        from engine.weights.description import ModelWeights

        state = self._base_state()
        ModelWeights({name: (tuple(t.shape), str(t.dtype)) for name, t in state.items()}).check(tensors)

    def _base_state(self) -> dict[str, Any]:
        """The base model's weights by their own names: with adapters loaded, PEFT's wrappers hold each changed
        weight as ``<module>.base_layer.weight`` beside the adapters' ``lora_A``/``lora_B`` (left out here)."""
        state = self.model.state_dict()
        if self.peft is None:
            return state
        return {name.replace(".base_layer.", "."): t for name, t in state.items() if ".lora_" not in name}

    def load_weights(self, announced: dict[str, Any], within_s: float = 300.0) -> int:
        """Receive the announced tensors and copy them into the model's state (tied weights follow)."""
        from engine.weights.description import check_finite
        from engine.weights.sync import receive

        received = receive(getattr(self, "weights", None), announced, within_s)
        check_finite(received)  # before any is copied in: a refused push leaves the model as it was
        return self._copy_in(received)

    def receive_adapter(self, announced: dict[str, Any], folder: str, config: dict[str, Any],
                        within_s: float = 300.0) -> int:
        from engine.adapters import write_adapter
        from engine.weights.sync import receive

        received = receive(getattr(self, "weights", None), announced, within_s)
        write_adapter(folder, config, received)
        return len(received)

    def load_checkpoint(self, path: str) -> int:
        """Every tensor of the checkpoint, checked (names, shapes) before any is copied in."""
        from pathlib import Path

        from engine.weights.checkpoint import checkpoint_description, checkpoint_tensors
        from engine.weights.description import check_finite

        headers = checkpoint_description(Path(path))  # names and shapes from the headers, before any tensor is read
        self._check_tensors([("model_path", name, shape) for name, (shape, _) in headers.items()])
        tensors = checkpoint_tensors(Path(path))
        check_finite(tensors, "model_path")  # every value before any is copied in: all or nothing
        return self._copy_in(tensors)

    def _copy_in(self, received: Sequence[tuple[str, Any]]) -> int:
        import torch

        state = self._base_state()
        unknown = [name for name, _ in received if name not in state]
        if unknown:
            raise RequestError("name", unknown[0], "is not a parameter of the served model",
                               fix="send the names GET /get_model_state_keys/ lists")
        with torch.no_grad():
            for name, tensor in received:
                state[name].copy_(tensor.to(device=state[name].device, dtype=state[name].dtype))
        self._originals.clear()  # merged adapters restore the new weights from now on
        return len(received)

    def finish_weights(self) -> None:
        """Nothing to finish: each push was copied into the model's own tensors."""

    def close_weights(self) -> None:
        self.weights = None

    def state_keys(self) -> list[str]:
        return list(self._base_state())

    def reset_cache(self, kind: str) -> None:
        """Nothing to drop: ``generate`` keeps no KV cache, encoder output or processed image between calls."""

    def close(self) -> None:
        self.model = None

    def generate(self, prompts: Sequence[Prompt], plan: CallPlan, *,
                 on_token: Callable[[int, int, int], bool | None] | None = None) -> list[BackendOutput]:
        """Outputs in prompt order. ``on_token(prompt_index, position, token_id)`` (for streaming) is called from
        inside ``generate`` for every token a row keeps, as soon as it is sampled; returning True ends that row
        (its caller went away)."""
        from engine.adapters import by_adapter

        outputs: list[BackendOutput | None] = [None] * len(prompts)
        for adapter, indices in by_adapter([p.adapter for p in prompts]):  # PEFT runs one adapter per forward
            size = self.settings.max_batch_size or max(len(indices), 1)
            for start in range(0, len(indices), size):
                chunk = indices[start : start + size]
                sink = None
                if on_token is not None:
                    def sink(row: int, position: int, token: int, chunk: list[int] = chunk) -> bool | None:
                        return on_token(chunk[row], position, token)
                with self._with_adapter(adapter):
                    done = self._generate_batch([prompts[i] for i in chunk], plan, sink)
                for i, out in zip(chunk, done, strict=True):
                    outputs[i] = out
        return outputs  # type: ignore[return-value]

    def generation_config(self, plan: CallPlan, max_new_tokens: int | None = None) -> Any:
        """The complete ``GenerationConfig`` for ``plan`` (nothing taken from the checkpoint); ``max_new_tokens``
        lowers the plan's (a batch whose every row meets the context's end sooner)."""
        from transformers import GenerationConfig

        opts = plan.options
        return GenerationConfig(
            max_new_tokens=min(opts.max_new_tokens, max_new_tokens or opts.max_new_tokens),
            min_new_tokens=opts.min_new_tokens or None,
            **{name: getattr(plan.processing, name) for name in HF_OWN},  # the rest: RowSampler's shared warp
            eos_token_id=list(plan.terminal_token_ids) or None,  # none with ignore_eos and no stop ids
            pad_token_id=self.tokenizer.pad_token_id,
            bos_token_id=self.tokenizer.bos_token_id,
            return_dict_in_generate=True,
            output_logits=opts.logprobs is not None and plan.logprobs_mode.startswith("raw"),
            num_beams=1,
            do_sample=False,  # sampled plans too: the backend's last logits processor draws (hf.sampling)
        )

    def _decode_skip_special(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _rule_text(self) -> Any:
        """What text-reading rules read: the tokenizer's byte table (built once), else incremental decode."""
        if not hasattr(self, "_text_table"):
            from engine.rules.token_text import TokenBytes

            self._text_table = TokenBytes.from_tokenizer(self.tokenizer)
        return self._text_table or self._decode_skip_special

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[Any, Any]:
        """(batch, width) input ids and attention mask, left-padded with the pad token."""
        import torch

        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # (batch, width)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            if p:
                ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
                mask[row, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _inputs(self, prompts: Sequence[Prompt], plan: CallPlan) -> dict[str, Any]:
        """Model inputs: the engine's ids left-padded, or on the VLM path the processor's expansion of them."""
        if not any(p.image is not None for p in prompts):
            input_ids, attention_mask = self._left_pad([p.token_ids for p in prompts])
            return {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.processor is None:
            raise EngineError("hf backend got an image but its model has no processor (not a VLM)")
        images = [p.image for p in prompts if p.image is not None]
        batch = self.processor(text=[p.text for p in prompts], images=images, padding=True, return_tensors="pt",
                               add_special_tokens=False, **plan.pixels.as_processor_kwargs())
        # Keep every processor output: Qwen2-VL computes its 3-D M-RoPE positions only from mm_token_type_ids.
        image_token = getattr(self.processor, "image_token_id", None)
        for row, p in enumerate(prompts):
            expanded = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            if collapse_runs(expanded, image_token) != list(p.token_ids):
                raise EngineError(f"hf processor tokenized request {row} differently from the engine's rendering; "
                                  "the checkpoint's processor and tokenizer disagree")
        return {k: v.to(self.device) for k, v in batch.items()}

    def _generate_batch(self, prompts: Sequence[Prompt], plan: CallPlan,
                        on_token: Callable[[int, int, int], bool | None] | None = None) -> list[BackendOutput]:
        import torch
        from transformers import LogitsProcessorList, StoppingCriteriaList

        from engine.backends.hf.rules import HfRowRules
        from engine.backends.hf.sampling import RowSampler, ScoreTap
        from engine.rules.base import rule_sets
        from engine.rules.detok import text_stream
        from engine.rules.stop import StopStringWatch

        inputs = self._inputs(prompts, plan)
        width = inputs["input_ids"].shape[1]
        decode = self._rule_text()
        stop_specs = [s for s in plan.rules if s.mechanism == "stopping_criteria"]
        logit_specs = [s for s in plan.rules if s.mechanism == "logits_processor"]
        min_new = plan.options.min_new_tokens
        stop_sets = rule_sets(stop_specs, len(prompts), terminal_ids=plan.terminal_token_ids, decode=decode,
                              min_new_tokens=min_new)
        watches = [StopStringWatch(plan.stop.strings, text_stream(decode), min_new_tokens=min_new)
                   for _ in prompts] if plan.stop.strings else None
        budgets = self._context_budgets(inputs["attention_mask"], plan.options.max_new_tokens)
        recorder = RowFinishRecorder(width, plan.terminal_token_ids, watches, stop_sets if stop_specs else None,
                                     on_token=on_token, budgets=budgets)
        processors = []
        if logit_specs:
            processors.append(HfRowRules(logit_specs, prompt_len=width, eos_id=plan.eos_token_ids[0],
                                         terminal_ids=plan.terminal_token_ids, decode=decode, min_new_tokens=min_new))
        # The grammar mask first, as vLLM applies it before its logits processors: the rules then see what the
        # grammar allows and never revive a token it masked (row_apply.apply_decisions).
        masks = self._grammar_processors(plan, len(prompts), width)
        opts = plan.options
        tap = ScoreTap() if opts.logprobs is not None and plan.logprobs_mode.startswith("processed") else None
        sampler: list[Any] = []
        if not opts.is_greedy:  # warpers after every other processor, then one draw per row with its own seed
            sampler.append(RowSampler([p.seed for p in prompts], plan.processing, sampler=opts.sampler, tap=tap,
                                      positions=(inputs["attention_mask"].sum(dim=1) - 1).tolist()))
        elif tap is not None:  # greedy: the draw is the argmax of what every processor left (vLLM's greedy path)
            sampler.append(tap)
        with torch.inference_mode():
            out = self.model.generate(**inputs, generation_config=self.generation_config(
                                          plan, max(budgets) if budgets else None),
                                      stopping_criteria=StoppingCriteriaList([recorder]),
                                      logits_processor=LogitsProcessorList(masks + processors + sampler))
        generated = out.sequences[:, width:].tolist()  # (batch, steps)
        results = []
        for row, ids in enumerate(generated):
            n = recorder.lengths[row] if row < len(recorder.lengths) and recorder.lengths[row] else len(ids)
            seen = inputs["input_ids"][row][inputs["attention_mask"][row].bool()].tolist()
            events: dict[str, Any] = {}
            for proc in processors:
                events.update(proc.events(row))
            if stop_specs and stop_sets:
                events.update(stopped_on_seen_token(stop_sets[row].events()))
            results.append(BackendOutput(token_ids=tuple(ids[:n]),
                                         logprobs=self._logprobs(out.logits if tap is None else tap.steps, row, n,
                                                                 ids, plan),
                                         prompt_token_ids=tuple(seen), events=events))
        return results

    def _context_budgets(self, attention_mask: Any, max_new_tokens: int) -> list[int] | None:
        """Per row, the tokens its prompt leaves of the context, when one row would otherwise run past it (None:
        ``max_new_tokens`` fits every row)."""
        limit = self.capabilities.max_model_len
        if limit is None:
            return None
        budgets = [limit - n for n in attention_mask.sum(dim=1).tolist()]
        return budgets if min(budgets) < max_new_tokens else None

    def compile_schema(self, schema: str) -> Any:
        """The compiled grammar of ``schema`` (a checked JSON Schema's canonical text), compiled once: the engine
        calls this while preparing a request, the batch then finds it ready."""
        from engine.backends.hf.structured import SchemaCompiler

        if self._schemas is None:
            self._schemas = SchemaCompiler(self.tokenizer, self.vocab_size)
        return self._schemas.compile(schema)

    def _grammar_processors(self, plan: CallPlan, batch: int, prompt_len: int) -> list[Any]:
        """The grammar mask of a constrained plan (sampling warpers come after it); none otherwise."""
        if plan.json_schema is None:
            return []
        from engine.backends.hf.structured import GrammarMask

        return [GrammarMask(self.compile_schema(plan.json_schema), batch, prompt_len, self.vocab_size)]

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
              top: int | None = None, processing: Any = None) -> list[TokenScores]:
        """Log-probabilities of ``sequences[i][starts[i]:]`` (each token given all before it) from one forward
        pass per batch of right-padded rows, whether each token was the model's argmax there, and with ``top`` the
        ``top`` likeliest tokens at each position. With ``processing`` (``engine.rules.processing.Processing``) the
        logits are processed as a sampled draw's were first, and each score carries its kept mass.

        Memory stays bounded whatever the client sends: a batch holds at most :data:`SCORE_TOKENS` tokens (rows
        beyond go to the next forward), and on a model whose logits are its output head's alone (:data:`PLAIN_HEAD`)
        the head runs over :data:`SCORE_POSITIONS` positions at a time from the decoder's hidden states, so a
        row's full-vocabulary logits never exist at once (8 rows of 8191 tokens would need ~13 GB of fp32 logits)."""
        import torch

        scores: list[TokenScores] = []
        rows = max(1, min(self.settings.max_batch_size or 8, SCORE_TOKENS // max(1, max(map(len, sequences),
                                                                                        default=1))))
        for first in range(0, len(sequences), rows):
            chunk, offsets = sequences[first : first + rows], starts[first : first + rows]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), self.tokenizer.pad_token_id, dtype=torch.long)  # (batch, width)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, seq in enumerate(chunk):
                ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
                mask[row, : len(seq)] = 1
            head = self._plain_head()
            with torch.inference_mode(), self._with_adapter(None):  # the base model, whatever adapter ran last
                if head is None:
                    out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
                else:  # (batch, width, hidden): the head runs per slice of positions below
                    out = self.model.get_decoder()(input_ids=ids.to(self.device),
                                                   attention_mask=mask.to(self.device)).last_hidden_state
                for row, (seq, start) in enumerate(zip(chunk, offsets, strict=True)):
                    scores.append(self._row_scores(out[row], head, seq, start, top, processing))
        return scores

    def _row_scores(self, out: Any, head: Any, seq: Sequence[int], start: int, top: int | None,
                    processing: Any) -> TokenScores:
        """One row's scores from its logits (``head`` None) or its hidden states (``head``: the output head)."""
        import torch

        from engine.rules.processing import reprocess

        # The token at position p is predicted by the logits at p - 1.
        if processing is not None:  # penalties read the whole row: its logits at once
            logits = out[start - 1 : len(seq) - 1] if head is None else head(out[start - 1 : len(seq) - 1])
            lp, mass = reprocess(logits, processing, seq, start)
            return self._scored(lp, seq[start:], top, tuple(mass.tolist()))
        parts = []
        for a in range(start - 1, len(seq) - 1, SCORE_POSITIONS):
            b = min(a + SCORE_POSITIONS, len(seq) - 1)
            logits = out[a:b] if head is None else head(out[a:b])
            parts.append(self._scored(torch.log_softmax(logits.float(), dim=-1), seq[a + 1 : b + 1], top, None))
        return TokenScores(logprobs=tuple(x for p in parts for x in p.logprobs),
                           greedy=tuple(x for p in parts for x in p.greedy),
                           top=None if top is None else tuple(x for p in parts for x in p.top))  # type: ignore[union-attr]

    @staticmethod
    def _scored(lp: Any, targets: Sequence[int], top: int | None, kept: tuple[float, ...] | None) -> TokenScores:
        import torch

        target = torch.tensor(list(targets), dtype=torch.long, device=lp.device)
        chosen = lp.gather(-1, target[:, None])[:, 0]
        greedy = lp.argmax(dim=-1) == target
        return TokenScores(logprobs=tuple(chosen.tolist()), greedy=tuple(greedy.tolist()),
                           top=None if top is None else top_alternatives(lp, target, top), kept_mass=kept)

    def _plain_head(self) -> Any:
        """The output head, where the model's logits are that head's output alone (else None: the full forward)."""
        if getattr(self.model.config, "model_type", None) not in PLAIN_HEAD or not hasattr(self.model, "get_decoder"):
            return None
        return self.model.get_output_embeddings()

    @staticmethod
    def _logprobs(logits: Any, row: int, n: int, ids: list[int], plan: CallPlan) -> Any:
        """Row ``row``'s top-k per step from ``logits`` (per step: batch x vocab, raw or as the draw saw them), as
        ``plan.logprobs_mode`` says: log-softmaxed (``*_logprobs``) or as they are (``*_logits``)."""
        k = plan.options.logprobs
        if k is None:
            return None
        import torch

        softmax = plan.logprobs_mode.endswith("logprobs")
        per_token = []
        for step in range(n):
            lp = logits[step][row].float()  # (vocab,)
            if softmax:
                lp = torch.log_softmax(lp, dim=-1)
            top = torch.topk(lp, k) if k else None
            entry = {int(t): float(v) for t, v in zip(top.indices, top.values, strict=True)} if top is not None else {}
            entry[ids[step]] = float(lp[ids[step]])
            per_token.append(entry)
        return tuple(per_token)


def top_alternatives(logprobs: Any, target: Any, k: int) -> tuple[dict[int, float], ...]:
    """Per row of ``logprobs`` (positions x vocab), its ``k`` likeliest token ids and the ``target`` token's."""
    import torch

    best = torch.topk(logprobs, k, dim=-1) if k else None
    out = []
    for row, token in enumerate(target.tolist()):
        entry = {} if best is None else dict(zip(best.indices[row].tolist(), best.values[row].tolist(), strict=True))
        entry[token] = float(logprobs[row, token])
        out.append(entry)
    return tuple(out)


def collapse_runs(ids: Sequence[int], token: int | None) -> list[int]:
    """``ids`` with every run of ``token`` collapsed to one (undoes image-placeholder expansion).

    >>> collapse_runs([1, 7, 7, 7, 2, 7], 7)
    [1, 7, 2, 7]
    """
    out: list[int] = []
    for t in ids:
        if token is not None and t == token and out and out[-1] == token:
            continue
        out.append(t)
    return out
