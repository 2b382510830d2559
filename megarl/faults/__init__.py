"""Fault tooling: injection, detectors, the non-finite guard, step dumps (docs/faults.md)."""

from megarl.faults.config import EVENT_TYPES, INJECTION_KINDS, DetectorConfig, FaultsConfig, InjectionConfig

__all__ = ["EVENT_TYPES", "INJECTION_KINDS", "DetectorConfig", "FaultsConfig", "InjectionConfig"]
