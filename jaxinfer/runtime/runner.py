"""ModelRunner: owns the device state (weights, KV cache) and runs the compiled step."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxinfer import ops
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.models.layers import pad_code_strides
from cpu_kernels.ragged_paged_attention import MAX_PAGE_SIZE as MAX_CPU_PAGE_SIZE
from jaxinfer.ops.kv_cache import allocate_kv_cache
from jaxinfer.runtime.draft_model import DraftModel
from jaxinfer.runtime import huge_pages, memory_maps
from jaxinfer.runtime.executable_cache import ExecutableCache
from jaxinfer.runtime.mesh import available_ram, tp_size
from jaxinfer.runtime.sampler import NO_LOGPROBS, TOKEN_LOGPROBS, TOP_LOGPROBS
from jaxinfer.runtime.sharding import allocate_sharded_kv_cache, shard_model
from jaxinfer.runtime.step import (StepFlags, flat_state, make_jitted_draft_step, make_jitted_step,
                                   unpack_output)
from jaxinfer.sched.output import RunnerOutput
from jaxinfer.sched.step_input import StepInput

logger = logging.getLogger(__name__)

# An XLA option at its default value, passed to a compile that must not be served from JAX's
# persistent cache: compile options are part of that cache's key, so the key is new (a miss),
# while the program compiles as it would without it.
_UNCACHED_COMPILE = {"xla_embed_ir_in_executable": False}


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        model: nnx.Module,
        num_pages: int,
        draft: DraftModel | None = None,  # run with the target in every step
        mesh: Mesh | None = None,  # place weights and KV cache on it (runtime/sharding.py)
    ):
        self.model_config = model_config
        self.engine_config = engine_config
        self.num_pages = num_pages
        self.mesh = mesh
        self.attention_backend = ops.resolve_backend(engine_config.attention_backend)
        # with tp > 1 the step's attention kernels run per device on the mesh (ops/sharded.py)
        self.flags = StepFlags(attention_backend=self.attention_backend,
                               mesh=mesh if tp_size(mesh) > 1 else None)
        if mesh is not None:
            shard_model(model, model_config, mesh)
        if ops.unrolled_layers_faster():
            model.unroll_layers()
        if mesh is None:  # rows of codes that do not share cache sets (int8 activations)
            pad_code_strides(model)
        graphdef, state = nnx.split(model)
        if mesh is None:  # CPU arrays only (rehome checks): fewer address translations
            state = huge_pages.rehome(state)
            nnx.update(model, state)  # the module's references move too: the old arrays go
        self.graphdef = graphdef
        self._state_leaves, self._treedef = flat_state(state)
        self._state = state
        self.draft = draft
        if draft is None:
            self._step = make_jitted_step(graphdef, self._treedef)
        else:
            self._draft_leaves, draft_treedef = flat_state(draft.state)
            self._step = make_jitted_draft_step(graphdef, self._treedef, draft.graphdef,
                                                draft_treedef)
        kv_dtype = engine_config.kv_cache_dtype or engine_config.dtype
        head_major = ops.head_major_cache(self.attention_backend)
        if head_major and engine_config.page_size > MAX_CPU_PAGE_SIZE:
            raise ValueError(f"page_size={engine_config.page_size} is larger than the CPU attention "
                             f"kernel takes ({MAX_CPU_PAGE_SIZE}); use attention_backend='xla'")
        if mesh is None:
            self.kv_cache = allocate_kv_cache(model_config, num_pages, engine_config.page_size,
                                              kv_dtype, head_major=head_major)
        else:
            self.kv_cache = allocate_sharded_kv_cache(model_config, num_pages,
                                                      engine_config.page_size, kv_dtype,
                                                      head_major=head_major, mesh=mesh)
        self._seen_signatures: set[tuple] = set()
        self._executables: dict[tuple, jax.stages.Compiled] = {}  # compiled ahead (compile())
        # A draft-model step (target + draft, three donated caches) is always compiled, one at a
        # time (compile()): preparing two at once, loaded or compiled, crashed jaxlib with a
        # segfault in a process that had run other engines before.
        self._executable_cache = None if draft is not None else ExecutableCache.from_jax_config()
        self._cache_context = "" if self._executable_cache is None else repr(
            (graphdef, draft and draft.graphdef, model_config, engine_config))
        self.num_compilations = 0
        self.compile_seconds = 0.0
        self.maps_per_executable = 0.0  # memory mappings one step executable took (measured)

    @property
    def state(self) -> nnx.State:
        """The target's weights (the step takes them as `flat_state`'s leaves)."""
        return self._state

    @state.setter
    def state(self, state: nnx.State) -> None:
        leaves, treedef = flat_state(state)
        if treedef != self._treedef:
            raise ValueError("the new state must have the structure of the runner's state")
        self._state, self._state_leaves = state, leaves

    # -- one step ---------------------------------------------------------------------------
    def execute(self, step_input: StepInput) -> RunnerOutput:
        """Runs one step on a host StepInput (numpy, padded); returns the sampled rows."""
        return self.dispatch(step_input).result()

    def dispatch(self, step_input: StepInput) -> PendingStep:
        """Starts one step (JAX runs it asynchronously; a new shape compiles first) and returns
        at once: the host can prepare the next step while this one runs."""
        flags = self.flags
        buf, layout = step_input.pack()
        signature = (layout, flags)
        is_new = signature not in self._seen_signatures
        t0 = time.perf_counter()
        level = logprob_level(step_input)
        args = self._step_args(buf, level)  # numpy: the call copies it in (no separate put)
        compiled = self._executables.get(signature)
        if compiled is None and is_new:  # compiled now, by jit
            memory_maps.check_room(1, self.maps_per_executable)
        result = compiled(*args) if compiled is not None else self._step(*args, layout, flags)
        out, draft_ids = self._keep_caches(result)
        if is_new:
            self._seen_signatures.add(signature)
            self.num_compilations += 1
            dt = time.perf_counter() - t0
            self.compile_seconds += dt
            logger.info("compiled a step for (T, S, P)=%s %s in %.1f s", step_input.shape, flags, dt)
        return PendingStep(out, draft_ids, step_input.num_rows, int(level) >= TOP_LOGPROBS)

    def _step_args(self, buf: np.ndarray | jax.Array, level: np.int32) -> tuple:
        """The step's arguments besides the static ones (the KV caches are donated)."""
        if self.draft is None:
            return self._state_leaves, self.kv_cache, buf, level
        d = self.draft
        return (self._state_leaves, self.kv_cache, self._draft_leaves, d.kv_cache, d.q_store, buf,
                level)

    def _keep_caches(self, result) -> tuple:
        """Takes the updated caches out of a step's result -> (SamplerOutput, drafts | None)."""
        if self.draft is None:
            out, self.kv_cache = result
            return out, None
        d = self.draft
        (out, draft_ids), self.kv_cache, d.kv_cache, d.q_store = result
        return out, draft_ids

    def restore_caches(self) -> bool:
        """After a failed step: re-allocates (zeroed, same shapes, dtypes and placement) each
        donated cache the step consumed or left as its own failed outputs, so the next step has
        buffers to run on. True when any was lost: every page's K/V is gone (so is the prefix
        cache's)."""
        lost = _consumed(self.kv_cache)
        if lost:
            self.kv_cache = _zeros_like(self.kv_cache)
        d = self.draft
        if d is not None:
            if _consumed(d.kv_cache):
                d.kv_cache, lost = _zeros_like(d.kv_cache), True
            if _consumed(d.q_store):
                d.q_store = _zeros_like(d.q_store)  # scratch of the step: nothing kept in it
        if lost:
            logger.warning("a failed step consumed the KV cache: re-allocated (%.1f MiB)",
                           param_bytes(self.kv_cache) / 2**20)
        return lost

    # -- ahead of time ----------------------------------------------------------------------
    def compile(self, step_inputs: Iterable[StepInput], num_threads: int = 1) -> int:
        """Prepares the executables of these inputs' shape buckets without running them: each is
        loaded from the executable cache (runtime/executable_cache.py) when it has it, else traced
        and compiled (XLA's compile itself may hit JAX's persistent cache) and saved there.
        `num_threads` > 1 overlaps one bucket's tracing (Python) with another's XLA compile.
        `execute` then runs them with no trace or compile. Returns how many were new."""
        pending = {}
        for si in step_inputs:
            signature = (si.pack()[1], self.flags)
            if signature not in self._seen_signatures and signature not in pending:
                pending[signature] = si
        if self.draft is not None:  # two draft-model steps compiled at once crashed XLA:CPU
            num_threads = 1
        items = list(pending.items())
        # the first executable alone, to measure its memory mappings; then the rest, if they fit
        groups = [items] if self.maps_per_executable else [items[:1], items[1:]]
        for group in filter(None, groups):
            memory_maps.check_room(len(group), self.maps_per_executable)
            before = memory_maps.in_use()
            inputs = [si for _, si in group]
            if num_threads > 1 and len(group) > 1:
                with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
                    results = list(pool.map(self._prepare, inputs))
            else:
                results = [self._prepare(si) for si in inputs]
            after = memory_maps.in_use()
            if before is not None and after is not None:
                self.maps_per_executable = max(self.maps_per_executable,
                                               (after - before) / len(group))
            for (signature, _), (compiled, dt) in zip(group, results):
                self._executables[signature] = compiled
                self._seen_signatures.add(signature)
                self.num_compilations += 1
                self.compile_seconds += dt
        return len(pending)

    def check_room(self, step_inputs: Iterable[StepInput]) -> None:
        """Raises RuntimeError when the executables these inputs still need, at the memory
        mappings each one took so far, would pass the process's limit (runtime/memory_maps.py)."""
        new = {(si.pack()[1], self.flags) for si in step_inputs} - self._seen_signatures
        memory_maps.check_room(len(new), self.maps_per_executable)

    def check_executables(self, step_inputs: Iterable[StepInput]) -> int:
        """Runs the prepared executable of each of these (all-padding) inputs once. One that fails
        is compiled again past both caches, saved over its cache entry and run once more (a
        second failure raises): an executable restored from a cache has been seen to lack one of
        its functions ("Function ... not found"), and would otherwise fail every step of its
        shape, on every start. Returns how many were compiled again."""
        seen, num_recompiled = set(), 0
        for step_input in step_inputs:
            signature = (step_input.pack()[1], self.flags)
            if signature in seen:
                continue
            seen.add(signature)
            try:
                self.execute(step_input)
            except Exception as e:  # noqa: BLE001 - compiled again below; a second failure raises
                logger.warning("the step for (T, S, P)=%s failed its first run (%s: %s); "
                               "compiling it again without the caches", step_input.shape,
                               type(e).__name__, e)
                self.restore_caches()
                self._executables[signature] = self._compile_uncached(step_input)
                num_recompiled += 1
                self.execute(step_input)
        return num_recompiled

    def _compile_uncached(self, step_input: StepInput) -> jax.stages.Compiled:
        """This input's step compiled afresh (JAX's persistent cache not read), saved over its
        executable cache entry."""
        return self._prepare(step_input, from_caches=False)[0]

    def _prepare(self, step_input: StepInput,
                 from_caches: bool = True) -> tuple[jax.stages.Compiled, float]:
        """(the Compiled step of this input's bucket, seconds); changes no state but the
        executable cache. `from_caches=False`: compiled, never loaded (from either cache)."""
        t0 = time.perf_counter()
        flags = self.flags
        buf, layout = step_input.pack()
        args = self._step_args(jax.device_put(buf), np.int32(NO_LOGPROBS))
        cache, key, compiled, how = self._executable_cache, None, None, "loaded"
        if cache is not None:
            key = cache.step_key((layout, flags), args, self._cache_context)
            ops.register_cpu_kernels()  # the loaded step's custom calls need their handlers
            compiled = cache.load(key, args) if from_caches else None
        if compiled is None:
            options = None if from_caches else _UNCACHED_COMPILE
            compiled, how = self._step.lower(*args, layout, flags).compile(options), "compiled"
            if cache is not None:
                cache.save(key, compiled)
        dt = time.perf_counter() - t0
        logger.info("%s a step for (T, S, P)=%s %s in %.2f s", how, step_input.shape, flags, dt)
        return compiled, dt


class PendingStep:
    """A dispatched step: `result()` waits for it and copies its sampled rows to the host (one
    array, two with a draft model)."""

    def __init__(self, out, draft_ids, num_rows: int, top_logprobs: bool):
        self._device = (out, draft_ids)
        self._num_rows = num_rows
        self._top_logprobs = top_logprobs
        self._result: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._result is None:
            packed, draft_ids = jax.device_get(self._device)
            host, n, want = unpack_output(packed), self._num_rows, self._top_logprobs
            self._device = None
            self._result = RunnerOutput(
                token_ids=np.ascontiguousarray(host.token_ids[:n]),
                logprobs=np.ascontiguousarray(host.logprobs[:n]),
                top_token_ids=np.ascontiguousarray(host.top_token_ids[:n]) if want else None,
                top_logprobs=np.ascontiguousarray(host.top_logprobs[:n]) if want else None,
                draft_token_ids=None if draft_ids is None else np.asarray(draft_ids),
            )
        return self._result


def _consumed(tree) -> bool:
    """Whether any array of `tree` is unusable: deleted (donated to a step that then failed) or
    the output of a step whose failure showed only when it was awaited (dispatch is async)."""
    for x in jax.tree_util.tree_leaves(tree):
        if x.is_deleted():
            return True
        try:
            x.block_until_ready()
        except Exception:  # noqa: BLE001 - the step's error, raised again by its outputs
            return True
    return False


def _zeros_like(tree):
    """Fresh zero arrays of `tree`'s shapes, dtypes and shardings (readable on deleted arrays)."""
    return jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), tree)


def device_memory_bytes_free() -> int | None:
    """Free memory of the default device; on the CPU, available RAM."""
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements it
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return available_ram()


def param_bytes(state: nnx.State) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(state) if hasattr(x, "nbytes"))


def kv_dtype_of(engine_config: EngineConfig):
    return jnp.dtype(engine_config.kv_cache_dtype or engine_config.dtype)


def logprob_level(step_input: StepInput) -> np.int32:
    """What the step's sampler computes besides tokens (runtime/sampler.py's levels): top
    logprobs when a row asks for some, the chosen tokens' logprobs when a row asks for logprobs
    or prompt logprobs, else nothing."""
    if step_input.num_top_logprobs > 0:
        return np.int32(TOP_LOGPROBS)
    return np.int32(TOKEN_LOGPROBS if step_input.needs_logprobs else NO_LOGPROBS)
