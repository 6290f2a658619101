"""scope=job: one namespace for the whole job (docs/consistency.md).

* :mod:`.log` — the job's namespace log: leader, ordering, leases, takeover, join.
* :mod:`.service` — its gRPC service and client calls (on the Peer server's port).
* :mod:`.sources` — fault-in of other ranks' files from the rank that wrote them.
"""
