"""The example axis: per-primitive rules, the microbatch analysis of a step's jaxpr, the self-indexing rewrite."""
