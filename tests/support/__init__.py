"""Helpers shared by test modules: ports, live servers. Test modules import from here, never
from each other."""
