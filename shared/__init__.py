"""Config, logging and small common types shared by the gateway, broker and workers (torch-free)."""
