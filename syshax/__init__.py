"""sysHAX farm: LLM serving that splits each generation between an accelerator and the CPU."""

__version__ = "0.1.0"
