"""``cpu``: device memory emulated in host RAM, always available; the last ``auto`` choice."""

from llm_datadist.runtimes.spec import RuntimeSpec

SPEC = RuntimeSpec(
    name="cpu",
    binding="host",
    description="device memory emulated in host RAM",
    capabilities=frozenset({"host_addressable"}),
    auto_priority=100,
)
