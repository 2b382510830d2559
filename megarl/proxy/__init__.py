"""Proxy models for fault reproduction: clustering-based expert pruning (``prune``), fault
injection, detection, step dump and replay (``replay``), and fidelity reports (``compare``).

Submodules are imported on use; this package import stays light (no transformers, no megatron).
"""
