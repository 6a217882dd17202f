"""`syshax` subcommands, one module each (imported on use)."""
