"""Precision variants of the optimized graph: FP32, FP16 mixed precision, INT8 (Q/DQ)."""
