"""Host-side scheduling (never imports JAX): pages, the scheduler, step inputs."""

from jaxinfer.sched.output import ScheduledRequest, SchedulerOutput
from jaxinfer.sched.page_pool import NULL_PAGE, PagePool, hash_page
from jaxinfer.sched.scheduler import Scheduler
from jaxinfer.sched.stats import SchedulerStats
from jaxinfer.sched.step_input import (StepBuckets, StepInput, all_buckets, make_step_input,
                                       unpack, warmup_step_inputs)

__all__ = ["NULL_PAGE", "PagePool", "hash_page", "Scheduler", "ScheduledRequest", "SchedulerOutput",
           "SchedulerStats", "StepBuckets", "StepInput", "all_buckets", "make_step_input", "unpack",
           "warmup_step_inputs"]
