"""One engine over the devices of several processes (hosts): JAX's multi-controller model.

Every process builds the same engine (same model, same settings); their devices form one global
mesh (`tensor_parallel_size` = all of them, e.g. 8 for two hosts of 4 GPUs). Process 0, the
leader, runs the scheduler, the server or the Python API. Every process must launch the same
jitted step with the same inputs in the same order, so before each step the leader broadcasts
the step's packed input buffer (and its static layout) to the others with
`jax.experimental.multihost_utils.broadcast_one_to_all`, an XLA collective over the same devices;
the followers (`follow`) run the step on it and drop its output. A broadcast of kind STOP ends
the followers' loop (`stop_followers`, also at the leader's exit).

    initialize_distributed(config)   # before any other JAX call: jax.distributed.initialize
    engine = LLMEngine(...)          # the same in every process; its runner is MultiHostRunner
    follow(engine.runner)            # processes 1..n-1; process 0 uses the engine as usual

On a CPU the processes use the gloo collectives. The leader's inputs are placed as global
replicated arrays (every process holds the same buffer), and its outputs are replicated, so each
process reads its own copy. Not supported across processes: data-parallel replicas, a draft
model, the executable cache.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import EngineConfig
from jaxinfer.runtime.runner import ModelRunner, logprob_level
from jaxinfer.sched.step_input import StepInput

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "JAXINFER_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXINFER_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXINFER_PROCESS_ID"
_STEP, _STOP = 1, 2  # message kinds


def distributed_settings(config: EngineConfig) -> tuple[str, int, int] | None:
    """(coordinator address, number of processes, this process's id) from the config, else from
    JAXINFER_COORDINATOR_ADDRESS / JAXINFER_NUM_PROCESSES / JAXINFER_PROCESS_ID; None for one
    process."""
    address = config.coordinator_address or os.environ.get(ENV_COORDINATOR)
    num = config.num_processes or int(os.environ.get(ENV_NUM_PROCESSES, "1"))
    pid = config.process_id if config.process_id is not None else \
        int(os.environ.get(ENV_PROCESS_ID, "0"))
    if num <= 1:
        return None
    if not address:
        raise ValueError(f"num_processes={num} needs coordinator_address (host:port of process 0)")
    if not 0 <= pid < num:
        raise ValueError(f"process_id={pid} must be in [0, {num})")
    return address, num, pid


def initialize_distributed(config: EngineConfig) -> bool:
    """jax.distributed.initialize for a multi-process engine (gloo collectives on a CPU); a
    no-op for one process or when already initialized. True when several processes run."""
    settings = distributed_settings(config)
    if settings is None:
        return False
    if jax.distributed.is_initialized():
        return True
    address, num, pid = settings
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=num, process_id=pid)
    logger.info("process %d of %d (coordinator %s): %d local of %d devices", pid, num, address,
                len(jax.local_devices()), len(jax.devices()))
    return True


def is_multi_process() -> bool:
    return jax.process_count() > 1


class MultiHostRunner(ModelRunner):
    """A ModelRunner whose step inputs are global (replicated) arrays, and whose `execute` on the
    leader broadcasts each step to the followers first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.mesh is None:
            raise ValueError("a multi-process engine needs tensor_parallel_size = all devices")
        if self.draft is not None:
            raise ValueError("a draft model is not supported across processes")
        self._replicated = NamedSharding(self.mesh, P())
        self._stopped = False
        if jax.process_index() == 0:
            atexit.register(self.stop_followers)

    def _step_args(self, buf, level) -> tuple:
        buf = jax.device_put(np.asarray(buf), self._replicated)  # the same value on every process
        level = jax.device_put(np.asarray(level), self._replicated)
        return super()._step_args(buf, level)

    def execute(self, step_input: StepInput):
        buf, layout = step_input.pack()
        _broadcast(_STEP, buf, layout, int(logprob_level(step_input)))
        return super().execute(step_input)

    def compile(self, step_inputs, num_threads: int = 1) -> int:
        """Every process must launch the same executables the same way, so ahead-of-time
        executables (the leader's alone) are not used: each new bucket is compiled by running it
        with the followers (warm-up inputs are all padding: only the null page is written)."""
        new = 0
        for si in step_inputs:
            if (si.pack()[1], self.flags) not in self._seen_signatures:
                self.execute(si)
                new += 1
        return new

    def stop_followers(self) -> None:
        """Ends the followers' loops (once; the leader only)."""
        if not self._stopped and jax.process_index() == 0:
            self._stopped = True
            _broadcast(_STOP, np.zeros(1, np.int32), (), 0)


def follow(runner: MultiHostRunner) -> int:
    """A follower's loop: runs every step the leader broadcasts until it broadcasts STOP.
    Returns the number of steps run."""
    if jax.process_index() == 0:
        raise ValueError("process 0 leads; only processes 1.. follow")
    steps = 0
    while True:
        kind, buf, layout, level = _receive()
        if kind == _STOP:
            return steps
        args = runner._step_args(buf, np.int32(level))
        result = runner._step(*args, layout, runner.flags)
        out, _ = runner._keep_caches(result)
        jax.block_until_ready(out)
        steps += 1


def _broadcast(kind: int, buf: np.ndarray, layout, level: int) -> None:
    """The leader's half of one message: a fixed-size header, then the payload it sizes."""
    meta = np.frombuffer(pickle.dumps(layout), np.uint8)
    header = np.array([kind, meta.size, buf.size, int(level)], np.int32)
    multihost_utils.broadcast_one_to_all(header)
    multihost_utils.broadcast_one_to_all((meta, buf.astype(np.int32)))


def _receive() -> tuple[int, np.ndarray, tuple, bool]:
    """A follower's half: (kind, i32[n] buffer, layout, level)."""
    header = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(4, np.int32)))
    kind, meta_size, buf_size, level = (int(v) for v in header)
    meta, buf = multihost_utils.broadcast_one_to_all(
        (np.zeros(meta_size, np.uint8), np.zeros(buf_size, np.int32)))
    layout = pickle.loads(np.asarray(meta).tobytes())
    return kind, np.asarray(buf), layout, int(level)
