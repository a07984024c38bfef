"""One engine over the devices of several processes (hosts): JAX's multi-controller model.

Every process builds the same engine (same model, same settings); their devices form one global
mesh (`tensor_parallel_size` = all of them, e.g. 8 for two hosts of 4 GPUs). Process 0, the
leader, runs the scheduler, the server or the Python API. Every process must launch the same
jitted step with the same inputs in the same order, so before each step the leader broadcasts
the step's packed input buffer (and its static layout) to the others with
`jax.experimental.multihost_utils.broadcast_one_to_all`, an XLA collective over the same devices;
the followers (`follow`) run the step on it and drop its output. A broadcast of kind STOP ends
the followers' loop (`stop_followers`, also at the leader's exit).

Failures end every process, with the error, in bounded time. The processes run in lockstep and
JAX's collectives wait for every process without a timeout (gloo waited 80 s and more), so a
process that cannot go on must leave: a process that exits closes its connections, and a
collective the others are waiting in then fails at once ("connection closed by peer").

- The leader exiting on an uncaught exception (the scheduler's, a caller's) between steps, where
  the followers wait for the next broadcast: it broadcasts ERROR with the message instead of
  STOP, and each follower raises `LeaderFailed` with it (both then exit through
  jax.distributed's shutdown as usual).
- A step that fails on the leader after its broadcast (the followers may be inside that step's
  collectives, or gone): the runner refuses every later step and cannot recover (RuntimeError
  from the engine's step), and at exit the leader leaves at once (`os._exit(1)`), skipping the
  shutdown barrier the followers could not reach. A leader that stays up after it (a server)
  keeps the followers waiting until it exits.
- A follower whose step (or receive) fails, including a collective failing because the leader
  left: it logs the error and leaves at once (`os._exit(1)`); an orderly exit would first wait
  in jax.distributed's shutdown barrier (5 minutes) for a leader blocked in the step's
  collectives. The leader's step then fails saying another process left (the case above).

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
import sys

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
_STEP, _STOP, _ERROR = 1, 2, 3  # message kinds (ERROR's layout is the leader's error message)
_PEER_LEFT = ("closed by peer", "Connection reset", "Connection refused")  # gloo's words for it


class LeaderFailed(RuntimeError):
    """Raised in a follower when process 0 ended the engine after an error (its message)."""


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
    """A ModelRunner whose step inputs are global (replicated) arrays, and whose `dispatch` on the
    leader broadcasts each step to the followers first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.mesh is None:
            raise ValueError("a multi-process engine needs tensor_parallel_size = all devices")
        if self.draft is not None:
            raise ValueError("a draft model is not supported across processes")
        self._replicated = NamedSharding(self.mesh, P())
        self._stopped = False
        self._failure: str | None = None  # why a step failed: no step runs after one
        if jax.process_index() == 0:
            atexit.register(self._at_exit)

    def _step_args(self, buf, level) -> tuple:
        buf = jax.device_put(np.asarray(buf), self._replicated)  # the same value on every process
        level = jax.device_put(np.asarray(level), self._replicated)
        return super()._step_args(buf, level)

    def dispatch(self, step_input: StepInput):
        """Broadcasts the step, then runs it to the end: a failure is seen here, before the next
        step is broadcast (the followers would run it), and ends the engine."""
        if self._failure is not None:
            raise RuntimeError(f"the multi-process engine failed: {self._failure}")
        buf, layout = step_input.pack()
        try:
            _broadcast(_STEP, buf, layout, int(logprob_level(step_input)))
            pending = super().dispatch(step_input)
            pending.result()
            return pending
        except Exception as e:
            self._failure = _describe(e)
            raise RuntimeError(f"the multi-process engine failed: {self._failure}") from e

    def restore_caches(self) -> bool:
        """After a failed step: the caches are global arrays of every process, which the
        followers would have to re-allocate in step, so the engine cannot go on (RuntimeError)."""
        if self._failure is not None:
            raise RuntimeError(f"the multi-process engine cannot recover: {self._failure}")
        return super().restore_caches()

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

    def check_executables(self, step_inputs) -> int:
        """Each bucket already ran, with the followers, when `compile` prepared it."""
        return 0

    def stop_followers(self, error: str | None = None) -> None:
        """Ends the followers' loops (once; the leader only, between steps): normally, or with
        `error`, which each follower raises as LeaderFailed."""
        if self._stopped or jax.process_index() != 0:
            return
        self._stopped = True
        if self._failure is not None:
            raise RuntimeError(f"cannot stop the followers after a failed step: {self._failure}")
        if error is None:
            _broadcast(_STOP, np.zeros(1, np.int32), (), 0)
        else:
            _broadcast(_ERROR, np.zeros(1, np.int32), error, 0)

    def _at_exit(self) -> None:
        if self._failure is not None:
            _leave(f"process 0 leaves the multi-process engine after a failed step: "
                   f"{self._failure}")
        error = getattr(sys, "last_value", None)  # set when exiting on an uncaught exception
        try:
            self.stop_followers(None if error is None else _describe(error))
        except Exception as e:  # noqa: BLE001 - a follower that left
            _leave(f"process 0 leaves the multi-process engine: stopping the followers failed: "
                   f"{_describe(e)}")


def follow(runner: MultiHostRunner) -> int:
    """A follower's loop: runs every step the leader broadcasts until it broadcasts STOP.
    Returns the number of steps run; raises LeaderFailed when the leader broadcasts an error.
    Any other failure ends this process at once (`_leave`: see the module docstring)."""
    if jax.process_index() == 0:
        raise ValueError("process 0 leads; only processes 1.. follow")
    steps = 0
    while True:
        try:
            kind, buf, layout, level = _receive()
            if kind == _STOP:
                return steps
            if kind == _ERROR:
                raise LeaderFailed(f"process 0 ended the engine after {steps} steps: {layout}")
            args = runner._step_args(buf, np.int32(level))
            result = runner._step(*args, layout, runner.flags)
            out, _ = runner._keep_caches(result)
            jax.block_until_ready(out)
        except LeaderFailed:
            raise
        except Exception as e:  # noqa: BLE001 - this process cannot go on in step with the others
            _leave(f"process {jax.process_index()} leaves the multi-process engine after {steps} "
                   f"steps: {_describe(e)}")
        steps += 1


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    if any(words in text for words in _PEER_LEFT):
        return f"another process of the engine left (its log says why): {text}"
    return text


def _leave(message: str) -> None:
    """Logs `message` and ends this process at once with status 1 (no atexit handlers, no
    jax.distributed shutdown barrier): the other processes' collectives then fail at once."""
    if logger.hasHandlers():
        logger.critical(message)
    else:
        print(message, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


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
