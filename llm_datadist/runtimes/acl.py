"""``acl`` (alias ``ascend``, ``npu``): Huawei Ascend through ACL, ``libascendcl.so`` opened with
dlopen (``LLM_DATADIST_ACL_LIBRARY`` overrides the path); the first ``auto`` choice.

Copies are synchronous ``aclrtMemcpy`` calls, one per descriptor; device memory is not host
memory and cannot move between processes yet (no IPC)."""

from llm_datadist.runtimes.spec import RuntimeSpec

SPEC = RuntimeSpec(
    name="acl",
    binding="acl",
    description="Ascend NPU through libascendcl.so",
    aliases=("ascend", "npu"),
    library="libascendcl.so",
    library_env="LLM_DATADIST_ACL_LIBRARY",
    capabilities=frozenset({"async_copy"}),
    auto_priority=10,
)
