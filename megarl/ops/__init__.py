"""Numerics on sharded data: vocab-parallel logits and packed sequences."""
