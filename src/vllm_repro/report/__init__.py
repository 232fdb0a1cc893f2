"""Reports: the step trace as [SCHED] lines, the timeline picture, the HTML index."""
