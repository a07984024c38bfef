"""Host-side scheduling (never imports JAX): pages, the scheduler, shape buckets, step inputs and
the packed step buffer, and the runner's output as the scheduler reads it."""

from jaxinfer.sched.buckets import StepBuckets, all_buckets
from jaxinfer.sched.output import RunnerOutput, ScheduledRequest, SchedulerOutput
from jaxinfer.sched.page_pool import NULL_PAGE, PagePool, hash_page
from jaxinfer.sched.scheduler import Scheduler
from jaxinfer.sched.stats import SchedulerStats
from jaxinfer.sched.step_buffer import PackedField, PackedLayout, pack, unpack
from jaxinfer.sched.step_input import StepInput, make_step_input, warmup_step_inputs

__all__ = ["NULL_PAGE", "PackedField", "PackedLayout", "PagePool", "RunnerOutput", "Scheduler",
           "ScheduledRequest", "SchedulerOutput", "SchedulerStats", "StepBuckets", "StepInput",
           "all_buckets", "hash_page", "make_step_input", "pack", "unpack", "warmup_step_inputs"]
