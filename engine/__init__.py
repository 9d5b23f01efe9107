"""Velox engine: local LLM chat with a compressed KV cache. Never imports Qt."""

__version__ = "0.1.0"
