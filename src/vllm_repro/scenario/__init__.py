"""Scenario files: the schema (pydantic) and the YAML loader."""

from .load import load_scenario, parse_scenario
from .schema import Scenario

__all__ = ["Scenario", "load_scenario", "parse_scenario"]
