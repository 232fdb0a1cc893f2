"""A plant for tests/integration/test_no_leftovers.py: vLLM's ``schedule()`` starts processes
that leave the worker's process group (issue 47): one in a new session (``setsid``) and one
double-forked, each a ``sleep`` whose pid is written to ``pidfile`` (one per line)."""

from __future__ import annotations

import os
import subprocess


def detached_sleep(ctx, pidfile: str) -> None:
    Scheduler = ctx.find("vllm.v1.core.sched.scheduler:Scheduler", "vllm.v1.core.scheduler:Scheduler")
    orig = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        if "spawned" not in ctx.notes:
            ctx.note("spawned", True)
            pids = [subprocess.Popen(["sleep", "300"], start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL).pid]
            r, w = os.pipe()
            first = os.fork()
            if first == 0:  # double fork: the grandchild's parent exits at once
                os.setsid()
                second = os.fork()
                if second == 0:
                    os.execvp("sleep", ["sleep", "300"])
                os.write(w, f"{second}\n".encode())
                os._exit(0)
            os.waitpid(first, 0)
            os.close(w)
            pids.append(int(os.read(r, 64).decode().strip()))
            os.close(r)
            with open(pidfile, "w") as fh:
                fh.write("".join(f"{p}\n" for p in pids))
        return orig(self, *args, **kwargs)

    ctx.patch(Scheduler, "schedule", schedule)
