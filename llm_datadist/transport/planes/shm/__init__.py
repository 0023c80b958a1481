"""``shm``: caches the peer allocated (``allocate_cache`` / ``allocate_blocks_cache``) mapped into
this process, moved with memcpy on the caller's thread; everything else of the link as ``cma``.

The owner allocates each such cache in a memfd of its own (``engine.shared_memory``: one sealed
file per cache, never shared by two caches or reused by a later allocation) and lists those
caches in its table reply, with an export id new for every registration, only to a peer that
``local_peer_refusal`` passes: a process of this host whose pid and uid the kernel proved
(``SO_PEERCRED``), of this user, not this one, offering the plane. The peer asks for the files it
needs (``OP_SHM_GET``, on its own Unix connection of the link, with the word it read at the
owner's ``proof_addr``: only a process the kernel lets ptrace the owner reads it, the reach cma
would have); the owner checks the asker again on that very connection (``SO_PEERCRED``, and
``local_peer_refusal``) and that word, and passes the files in the
reply (``SCM_RIGHTS``; never over TCP: a TCP connection carries no descriptors and is refused).
The peer checks each file (a memfd sealed against shrinking, as large as the owner says, every
tensor of the table inside it), maps it once, and keeps the mapping per (cache, export id) in its
link state; a table that no longer lists it (the cache left the owner's registry: unregistered,
deallocated) or the end of the link drops the mapping.

The registry generation rules are cma's (this plane accepts a link only where cma does, and uses
cma's mapped generation counter): before each transfer the peer's generation is compared with the
table's, and a changed registry makes the manager refresh the table and plan again. A transfer
whose remote side lies in a mapped cache is range-checked against the table and translated into
the mapping, then copied with memcpy; any other (memory the peer registered from numpy or torch)
goes through cma. A peer that keeps a mapping after the owner dropped the cache reaches only that
cache's old file: the owner's later allocations are new files.
"""

from llm_datadist.transport.planes.shm.files import MAX_FDS_PER_REQUEST, MappedCache, fetch_files, map_file
from llm_datadist.transport.planes.shm.plane import CMA, MAX_SHARED_CACHES, ShmFacts, ShmLink, ShmPlane

__all__ = ["ShmPlane", "ShmLink", "ShmFacts", "MappedCache", "CMA", "MAX_SHARED_CACHES", "MAX_FDS_PER_REQUEST",
           "fetch_files", "map_file"]
