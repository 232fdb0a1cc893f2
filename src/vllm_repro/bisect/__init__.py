"""Release bisection: the first bad (or first fixed) vLLM release for a scenario, by binary
search over the index's releases (:mod:`.search`), each release run by the lab (:mod:`.run`)."""
