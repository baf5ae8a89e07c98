"""Adaptive tensor-parallel generation engine.

model (weights as views) <- engine (continuous batching, one TP group) <- regroup (layout changes in place)
<- rank (one process per device) <- generator (the pod's ranks driven from one process).
"""
