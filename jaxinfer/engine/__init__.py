"""The engine: `LLMEngine` (the step loop), its output processing, and `AsyncEngine` (the engine on
a thread of its own, for asyncio callers such as the server). `EngineClient` is the protocol both
the real engine and the test fakes implement."""

from jaxinfer.engine.client import EngineClient
from jaxinfer.engine.llm_engine import EngineMetrics, LLMEngine

__all__ = ["EngineClient", "EngineMetrics", "LLMEngine"]
