"""Backend and device detection, and the CPU layer that lets megatron-core run on gloo ranks."""

from harness.platform.backend import Platform, detect_platform, resolve_backend

__all__ = ["Platform", "detect_platform", "resolve_backend"]
