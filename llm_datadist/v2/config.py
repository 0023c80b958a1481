"""CANN's ``llm_datadist.v2.config``. CANN defines ``ClusterConfig`` and ``EngineConfig`` here,
the v1 mode's reading of GE options and NUMA resource files; the v1 mode is not implemented, so
this module has only the names CANN's imports that this package has."""

from llm_datadist.configs import LlmConfig, LLMRole, trans_str_ip
