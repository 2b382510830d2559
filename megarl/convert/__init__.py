"""HF <-> Megatron weight conversion (names, TP/EP sharding, bounded buckets)."""
