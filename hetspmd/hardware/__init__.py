"""Hardware as values: device specs and links, the profiler that measures them, the Cluster, the (data, model) mesh."""
