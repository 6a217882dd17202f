"""Worker processes and the inference engine they own."""
