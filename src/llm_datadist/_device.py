"""Former home of device-runtime selection, kept so existing imports work: the registry in
``llm_datadist.runtimes`` owns it now."""

from llm_datadist.runtimes import probe, select_runtime

__all__ = ["probe", "select_runtime"]
