"""Starting the vLLM engine of a worker, with our KV connector, and driving one request."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from mooncake.auth import kv_key
from mooncake.control import ControlEndpoint
from mooncake.engine.config import WorkerConfig, cpu_bind_error
from mooncake.engine.kv_events import publisher_endpoint
from mooncake.engine.prefill_overlap import PrefillOverlap
from mooncake.protocol import CONSUMER_KEY, LOADED_TOKENS_KEY, GenerateChunk, GenerateRequest

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

# vLLM loads our connector by name and module path inside its own processes; the shell names it
# here and never imports it (the connector composes the prefill and decode halves: kv_connector/).
CONNECTOR_CLASS = "MooncakeServeConnector"
CONNECTOR_MODULE = "kv_connector.connector"
# The node's KVCache pool (store/) reaches the engine through a second connector, composed with
# ours by vLLM's MultiConnector (ours first: a pulled prompt is its to load).
POOL_CONNECTOR_CLASS = "MooncakePoolConnector"
POOL_CONNECTOR_MODULE = "kv_connector.pool_connector"


def set_engine_environment(config: WorkerConfig) -> None:
    """vLLM-CPU reads these at engine start; set them before the engine is built."""
    # Its legacy whole-GiB setting would override the engine argument the KV cache size goes in
    # (kv_cache_memory_bytes, see kv_cache_bytes), which also takes fractions.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if config.cpu_bind:
        # Checked here, where the worker runs (its cpuset is this machine's): vLLM would pin
        # threads to cores outside it, or fail obscurely.
        if error := cpu_bind_error(config.cpu_bind, os.sched_getaffinity(0)):
            raise ValueError(error)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_bind
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")


def build_engine(config: WorkerConfig, kv_port: int, events_port: int, control: ControlEndpoint,
                 stat_loggers: list | None = None, pool: ControlEndpoint | None = None) -> "AsyncLLM":
    """`stat_loggers`: vLLM stat logger factories, called with the engine's figures after each
    step (mooncake/engine/stat_logger.py). `pool`: the local channel of this node's KVCache pool
    service (None: no pool)."""
    set_engine_environment(config)
    # Imported here: importing vLLM takes seconds and must follow the environment above.
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=config.model,
        served_model_name=[config.served_model_name],
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        enforce_eager=config.enforce_eager,
        kv_cache_memory_bytes=kv_cache_bytes(config),
        enable_log_requests=False,
        # Per-request timestamps (RequestOutput.metrics) exist only with stats on; run_request
        # reports the measured prefill and decode-step times from them.
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(**kv_transfer_settings(config, kv_port, control, pool)),
        # vLLM's own block stored/removed events feed the conductor's global prefix index.
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                        endpoint=publisher_endpoint(events_port), topic="kv"),
    )
    return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)


def kv_cache_bytes(config: WorkerConfig) -> int | None:
    """The KV cache size on CPU; None on a GPU, where vLLM sizes it by --gpu-memory-utilization."""
    from vllm.platforms import current_platform

    return int(config.kv_cache_gib * 2**30) if current_platform.is_cpu() else None


def kv_transfer_settings(config: WorkerConfig, kv_port: int, control: ControlEndpoint,
                         pool: ControlEndpoint | None) -> dict:
    """vLLM's KVTransferConfig fields: our connector alone, or with the pool's beside it."""
    serve = dict(
        kv_connector=CONNECTOR_CLASS,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={"kv_host": config.kv_host, "kv_port": kv_port,
                                   **({"kv_advertise_host": config.advertise_host} if config.advertise_host else {}),
                                   "control_path": control.path, "control_key": control.authkey_hex,
                                   # A key derived from the cluster token, not the token itself.
                                   **({"kv_auth_key": kv_key(config.cluster_token).hex()}
                                      if config.cluster_token else {})},
    )
    # A lost or corrupt transfer (or pool block) is recomputed locally: slower, never wrong text.
    if pool is None:
        return {**serve, "kv_load_failure_policy": "recompute"}
    pooled = dict(kv_connector=POOL_CONNECTOR_CLASS, kv_connector_module_path=POOL_CONNECTOR_MODULE,
                  kv_role="kv_both", kv_connector_extra_config={"pool_path": pool.path, "pool_key": pool.authkey_hex})
    return dict(kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"connectors": [serve, pooled]})


def sampling_params(request: GenerateRequest):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = request.sampling
    return SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        min_p=s.min_p, seed=s.seed, min_tokens=s.min_tokens,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, logit_bias=dict(s.logit_bias) or None,
        logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs,
        structured_outputs=structured_outputs(s.structured),
        # The conductor detokenizes (it owns stop strings across the prefill/decode boundary).
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": request.kv_transfer_params} if request.kv_transfer_params else None,
    )


def structured_outputs(structured: tuple[str, str] | None):
    """vLLM's constraint for a (kind, spec) pair of Sampling.structured (see mooncake/protocol.py)."""
    if structured is None:
        return None
    import json

    from vllm.sampling_params import StructuredOutputsParams

    kind, spec = structured
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind in ("json", "choice"):
        return StructuredOutputsParams(**{kind: json.loads(spec)})
    return StructuredOutputsParams(**{kind: spec})  # regex, grammar


def position_logprobs(position) -> list[tuple[int, float, int]]:
    """One position's {token id: Logprob} (vLLM's order: chosen token first) as wire entries."""
    return [(token, max(lp.logprob, -9999.0), lp.rank) for token, lp in position.items()]


async def run_request(engine: "AsyncLLM", request: GenerateRequest,
                      overlap: PrefillOverlap | None = None) -> AsyncIterator[GenerateChunk]:
    """Yields token deltas. Closing the iterator early aborts the request inside vLLM. The last
    chunk carries the engine's measured times (see measured_times) and, with `overlap` (the
    engine's record of prompts in prefill), how many other prompts were computed meanwhile."""
    rid = request.request_id
    # A prompt whose KV is pulled from a prefill worker is loaded, not computed here.
    computes = overlap is not None and CONSUMER_KEY not in (request.kv_transfer_params or {})
    if computes:
        overlap.submitted(rid, time.monotonic())
    first = True
    try:
        async for output in engine.generate(
            {"prompt_token_ids": request.prompt_token_ids}, sampling_params(request), rid
        ):
            if first and computes:
                overlap.first_output(rid, time.monotonic())
            completion = output.outputs[0]
            times = measured_times(output.metrics, overlap, rid) if output.finished else {}
            if output.finished and (loaded := (output.kv_transfer_params or {}).get(LOADED_TOKENS_KEY)):
                times["prefill_loaded_tokens"] = int(loaded)
            logprobs = None
            if request.sampling.logprobs is not None:
                logprobs = [position_logprobs(p) for p in completion.logprobs or ()]
            prompt_logprobs = None
            # In DELTA mode vLLM hands each part of the prompt's logprobs out once (with a chunked
            # prompt, possibly over several outputs); the conductor concatenates them.
            if request.sampling.prompt_logprobs is not None and output.prompt_logprobs:
                prompt_logprobs = [None if p is None else position_logprobs(p) for p in output.prompt_logprobs]
            yield GenerateChunk(
                token_ids=list(completion.token_ids),
                finish_reason=completion.finish_reason if output.finished else None,
                stop_reason=stop_token(completion) if output.finished else None,
                num_cached_tokens=output.num_cached_tokens if first else None,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                **times,
            )
            first = False
    finally:
        if computes:  # it ended before its first output (an abort, an error): its span ends now
            overlap.first_output(rid, time.monotonic())


def stop_token(completion) -> int | None:
    """The stop_token_ids entry that ended a finished completion (vLLM's stop_reason; None for
    EOS, a length cut, or a stop string, which the engine never sees)."""
    reason = completion.stop_reason
    return reason if isinstance(reason, int) and not isinstance(reason, bool) else None


def refusal(exc: BaseException) -> str | None:
    """What vLLM said when it refused a request as invalid (a client error: a regex, grammar or
    JSON schema it cannot compile, a parameter out of its range); None for any other failure.
    Its validation raises VLLMClientError or ValueError, which AsyncLLM.generate re-raises as is
    or wraps in EngineGenerateError. Matched by class name: importing vLLM here costs seconds."""
    if any(c.__name__ == "EngineGenerateError" for c in type(exc).__mro__) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, ValueError) or any(c.__name__ == "VLLMClientError" for c in type(exc).__mro__):
        return str(exc) or type(exc).__name__
    return None


def measured_times(stats, overlap: PrefillOverlap | None = None, request_id: str = "") -> dict[str, float]:
    """queued_s, prefill_s and decode_step_s of a finished request, from vLLM's RequestStateStats
    (engine-core monotonic timestamps: the host's CLOCK_MONOTONIC, which this process shares; 0.0
    means not recorded). A time that was not recorded, or that does not apply (decode_step_s needs
    two generated tokens), is left out. With `overlap`, each span's time comes with how many other
    prompts the engine computed during it (prefill_concurrent, decode_concurrent): another prompt's
    chunk lengthens the steps it rides in, so the conductor calibrates only on low counts."""
    queued = getattr(stats, "queued_ts", 0.0)
    scheduled = getattr(stats, "scheduled_ts", 0.0)
    first = getattr(stats, "first_token_ts", 0.0)
    last = getattr(stats, "last_token_ts", 0.0)
    n = getattr(stats, "num_generation_tokens", 0)
    times: dict[str, float] = {}
    if queued > 0 and scheduled >= queued:
        times["queued_s"] = scheduled - queued
    if scheduled > 0 and first > scheduled:
        times["prefill_s"] = first - scheduled
        if overlap is not None:
            times["prefill_concurrent"] = overlap.others(request_id, scheduled, first)
    if n >= 2 and first > 0 and last > first:
        times["decode_step_s"] = (last - first) / (n - 1)
        if overlap is not None:
            times["decode_concurrent"] = overlap.others(request_id, first, last)
    return times


def kv_capacity_tokens(engine: "AsyncLLM") -> tuple[int, int]:
    """(block size, KV cache capacity in tokens) as the running engine sized them."""
    cache = engine.vllm_config.cache_config
    blocks = cache.num_gpu_blocks or 0
    return cache.block_size, blocks * cache.block_size
