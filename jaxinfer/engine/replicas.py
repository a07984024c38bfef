"""Data parallelism: `data_parallel_size` engine replicas on disjoint device groups, one client.

    engine = make_engine(model, data_parallel_size=4, tensor_parallel_size=2)  # 8 devices

Replica i is a whole `LLMEngine` on devices [i tp, (i + 1) tp) of `jax.devices()` (its own
weights, page pool, scheduler and compiled steps); `ReplicatedEngine` implements `EngineClient`
over them, so `LLM`, `AsyncEngine` and the server drive it like one engine. A new request goes to
one replica for its whole life, chosen by sched/router.py (least queued prefill work net of the
prompt's prefix cached there). `step()` steps every replica with work at once, each on a thread
of its own (JAX releases the GIL while a step runs, so the replicas' devices work in parallel),
and returns all their outputs.

A replica whose step fails recovers by itself (LLMEngine); its StepFailed is raised on the next
`step()` call, after this call's outputs of the other replicas are returned (a finished output
is never dropped). Not supported with replicas: a draft model (its cache is not placed on the
replica's devices).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Sequence

import jax

from jaxinfer.config import EngineConfig
from jaxinfer.engine.client import EngineClient, StepFailed
from jaxinfer.engine.llm_engine import EngineMetrics, LLMEngine
from jaxinfer.request import RequestOutput
from jaxinfer.runtime.mesh import device_group
from jaxinfer.runtime.multihost import MultiHostRunner, follow, initialize_distributed
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.sched.router import pick_replica

logger = logging.getLogger(__name__)


def make_engine(model: str, *, tokenizer: str | None = None, **engine_kwargs) -> EngineClient:
    """An `LLMEngine`, or a `ReplicatedEngine` when data_parallel_size > 1. Joins a multi-process
    job first when the settings (or the environment) name one (runtime/multihost.py)."""
    if initialize_distributed(EngineConfig(**engine_kwargs)) and \
            engine_kwargs.get("data_parallel_size", 1) > 1:
        raise ValueError("data_parallel_size > 1 is not supported across processes")
    if engine_kwargs.get("data_parallel_size", 1) > 1:
        return ReplicatedEngine(model, tokenizer=tokenizer, **engine_kwargs)
    return LLMEngine(model, tokenizer=tokenizer, **engine_kwargs)


def run_follower(engine: EngineClient) -> bool:
    """In processes 1.. of a multi-process engine: runs the steps process 0 broadcasts until it
    stops, then returns True. False (at once) in process 0 or a single-process engine."""
    runner = getattr(engine, "runner", None)
    if not isinstance(runner, MultiHostRunner) or jax.process_index() == 0:
        return False
    logger.info("following process 0's steps")
    logger.info("process 0 stopped; %d steps followed", follow(runner))
    return True


class ReplicatedEngine:
    def __init__(self, model: str, *, tokenizer: str | None = None, **engine_kwargs):
        config = EngineConfig(**engine_kwargs)
        if config.speculative_method == "draft":
            raise ValueError("speculative_method='draft' is not supported with "
                             f"data_parallel_size={config.data_parallel_size} (ngram is)")
        tp = config.tensor_parallel_size
        groups = [device_group(tp, i) for i in range(config.data_parallel_size)]  # checks count
        replica_kwargs = dict(engine_kwargs, data_parallel_size=1)
        self.replicas: list[LLMEngine] = []
        for i, devices in enumerate(groups):
            self.replicas.append(LLMEngine(model, tokenizer=tokenizer, devices=devices,
                                           **replica_kwargs))
            logger.info("replica %d/%d on %s", i + 1, len(groups), [str(d) for d in devices])
        self.engine_config = config
        first = self.replicas[0]
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.model_config = first.model_config
        self._owner: dict[str, int] = {}  # request id -> replica index, while unfinished
        self.num_routed = [0] * len(self.replicas)  # requests each replica was given
        self._pending_failure: StepFailed | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.replicas),
                                                           thread_name_prefix="replica")

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    background: bool = False, arrival_time: float | None = None) -> None:
        if request_id in self._owner:
            raise ValueError(f"request_id={request_id!r} is already in use")
        token_ids = None
        if self.engine_config.enable_prefix_caching:
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        index = pick_replica([r.scheduler for r in self.replicas], token_ids)
        self.replicas[index].add_request(request_id, prompt, params, priority=priority,
                                         arrival_time=arrival_time, background=background)
        self._owner[request_id] = index
        self.num_routed[index] += 1

    def abort_request(self, request_id: str) -> None:
        index = self._owner.pop(request_id, None)
        if index is not None:
            self.replicas[index].abort_request(request_id)

    def finish_request(self, request_id: str, reason: str = "stop",
                       stop_reason: str | int | None = None) -> None:
        index = self._owner.pop(request_id, None)
        if index is not None:
            self.replicas[index].finish_request(request_id, reason, stop_reason=stop_reason)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    # -- the step ---------------------------------------------------------------------------
    def step(self, detokenize: bool = True) -> list[RequestOutput]:
        """One step of every replica that has work, concurrently; their outputs together."""
        if self._pending_failure is not None:
            failure, self._pending_failure = self._pending_failure, None
            raise failure
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        futures = [self._pool.submit(r.step, detokenize) for r in busy]
        outputs: list[RequestOutput] = []
        failed: list[StepFailed] = []
        other: BaseException | None = None
        for future in futures:
            try:
                outputs.extend(future.result())
            except StepFailed as e:
                failed.append(e)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others
                other = other or e
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        for e in failed:
            for request_id in e.request_ids:
                self._owner.pop(request_id, None)
        if other is not None:
            raise other
        if failed:
            ids = [i for e in failed for i in e.request_ids]
            failure = StepFailed(ids, failed[0].cause)
            if not outputs:
                raise failure
            self._pending_failure = failure
        return outputs

    def warmup(self) -> None:
        for replica in self.replicas:
            replica.warmup()

    @property
    def metrics(self) -> EngineMetrics:
        """The replicas' metrics summed (counts, pages, seconds): the set as one engine."""
        snapshots = [r.metrics for r in self.replicas]
        return EngineMetrics(**{f.name: sum(getattr(m, f.name) for m in snapshots)
                                for f in dataclasses.fields(EngineMetrics)})

    def weight_bytes(self) -> int:
        return sum(r.weight_bytes() for r in self.replicas)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
