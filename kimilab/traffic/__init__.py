"""Traffic: the one Request, seeded generators, Mooncake trace I/O and statistics."""
