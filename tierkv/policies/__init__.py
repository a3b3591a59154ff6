"""Policies by name: full, streaming, h2o, razor, quest, leoam, omnikv, tierkv (the default)."""
from . import full, h2o, leoam, omnikv, quest, razor, streaming, tierkv  # noqa: F401  (registration)
from .base import REGISTRY, Policy, make_policy

__all__ = ["REGISTRY", "Policy", "make_policy"]
