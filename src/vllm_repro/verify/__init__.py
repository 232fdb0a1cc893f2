"""Verify a patch on CPU: apply it to a copy of the release's tree, run before and after."""
