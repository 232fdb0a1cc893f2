"""Fuzzing: hypothesis strategies over scenarios, a parallel search, shrinking by signature."""
