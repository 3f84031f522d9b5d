"""Compiler passes over the hetspmd IR (import as ``hetspmd.passes``)."""

from hetspmd.passes.costing.flops import COST_RULES as COST_RULES
from hetspmd.passes.costing.flops import Cost as Cost
from hetspmd.passes.costing.flops import register as register_cost_rule
from hetspmd.passes.ir import Edge as Edge
from hetspmd.passes.ir import Graph as Graph
from hetspmd.passes.ir import GraphInput as GraphInput
from hetspmd.passes.ir import GraphOutput as GraphOutput
from hetspmd.passes.ir import Layer as Layer
from hetspmd.passes.ir import Loop as Loop
from hetspmd.passes.ir import Node as Node
from hetspmd.passes.ir import Role as Role
from hetspmd.passes.ir import Source as Source
from hetspmd.passes.ir import TensorType as TensorType
from hetspmd.passes.ir import ValueRef as ValueRef
from hetspmd.passes.frontend.tracing import trace as trace

__all__ = [
    "COST_RULES", "Cost", "Edge", "Graph", "GraphInput", "GraphOutput", "Layer", "Loop", "Node", "Role",
    "Source", "TensorType", "ValueRef", "register_cost_rule", "trace",
]
