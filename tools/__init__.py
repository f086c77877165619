"""Developer tools (not part of the memsafe package)."""
