"""Remote GPU verification: ship a verification bundle to a GPU host with fabric
(:mod:`~vllm_repro.remote.ship`), judge it there inside the CUDA image with the shared suite on
the installed full vLLM (:mod:`~vllm_repro.remote.gpu_judge`), bring JUnit XML, logs and a summary
back. The command line is in :mod:`vllm_repro.commands.remote`."""
