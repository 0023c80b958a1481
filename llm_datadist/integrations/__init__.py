"""Integrations with serving engines. Each submodule imports its engine when it is imported
itself; importing this package needs nothing beyond llm_datadist."""
