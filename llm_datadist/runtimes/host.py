"""``host``: plain host memory (``Placement.HOST`` caches); memcpy, no device. Not a
``LLM_DATADIST_DEVICE`` value."""

from llm_datadist.runtimes.spec import RuntimeSpec

SPEC = RuntimeSpec(
    name="host",
    binding="host",
    description="host memory, memcpy",
    capabilities=frozenset({"host_addressable"}),
    selectable=False,
)
