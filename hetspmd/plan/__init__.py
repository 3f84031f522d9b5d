"""The Plan: its versioned JSON, options (remat, ZeRO, reduce dtypes), microbatch counts, and the state layout."""
