"""Method families from the seed papers (one subpackage per family; each module registers itself)."""
