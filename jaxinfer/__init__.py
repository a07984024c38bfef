"""jaxinfer: an LLM inference engine on JAX/XLA."""

from jaxinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "LLMEngine"]


def __getattr__(name):  # lazy: importing jaxinfer must not import jax for host-only users
    if name == "LLM":
        from jaxinfer.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxinfer.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
