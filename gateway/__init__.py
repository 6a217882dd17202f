"""OpenAI-compatible HTTP gateway (torch-free)."""
