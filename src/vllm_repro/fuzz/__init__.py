"""Fuzzing: a hypothesis state machine over the engine's calls (machine), an example database
in the cache (database), a parallel search and shrinking by signature (search), profiles
(strategies)."""
