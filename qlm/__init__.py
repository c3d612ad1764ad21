"""QLM: a queue-management control plane for LLM serving."""

__version__ = "0.1.0"
