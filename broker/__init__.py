"""Everything that talks to Redis (torch-free)."""
