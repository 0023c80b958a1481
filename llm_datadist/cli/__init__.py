"""The command line (``python -m llm_datadist {demo,bench,info}``): the parser in ``main``, one
module per command, and the workloads they run. It uses the public face, ``testing``, the engine
seam (``LLMDataDist.engine``) and the plane and runtime registries; the in-run baselines reach the
core through ``cli/baselines.py`` only."""
