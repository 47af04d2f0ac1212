"""Tools around the core: the CLI, profiling traces, schedule pictures and recommendations, and the
installed extension's self-check."""
