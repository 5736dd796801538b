"""tracegym: train LLM agents in executable, verifiable multi-turn environments."""

__version__ = "0.1.0"
