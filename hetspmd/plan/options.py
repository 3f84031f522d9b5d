"""A plan's options: the values each choice may take, shared by the Plan, the planner and the lowering."""

from __future__ import annotations

# The mesh axis of pipeline stages (lockstep ticks over a layer stack)


STAGE_AXIS = "stage"


ZERO_STAGES = (0, 1, 3)


# What a microbatch's forward pass saves for its backward pass, from most to least: everything ("none"),
# every matmul's output ("all_dots": dots_saveable), those without batch dimensions ("dots":
# dots_with_no_batch_dims_saveable, attention's batched matmuls recomputed), each layer's inputs only ("layers":
# every numbered layer recomputed from its inputs just before its backward pass, on the traced step), nothing
# ("full"). "all_dots", "dots" and "full" checkpoint the loss of a step written with hetspmd.value_and_grad;
# "layers" rewrites the traced step, whatever differentiated it
REMAT_POLICIES = ("none", "all_dots", "dots", "layers", "full")


# The policies every step gets, however it differentiates its loss (see hetspmd.passes.remat)
STEP_REMAT_POLICIES = ("none", "layers")


# The dtype gradients cross the data axis in: float32 (exact), or bfloat16, halving the bytes on the wire
# (the microbatch accumulation stays float32 either way; see hetspmd.lowering.weighted). Not float16: without loss
# scaling its range (6e-5 to 65504 for normal values) loses ordinary gradients to underflow and large ones
# to overflow
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")


SpecEntry = None | str | tuple[str, ...]


Spec = tuple[SpecEntry, ...]
