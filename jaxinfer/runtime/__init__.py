"""The device side: the jitted step (step.py) with its sampler and speculative verification, the
draft model, the runner that owns the weights and KV caches, the executable cache, and the
host-side draft proposers that feed the next step (spec_decode.py)."""
