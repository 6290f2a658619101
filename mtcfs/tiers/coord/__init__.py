"""Agreement between the nodes of a job, kept in etcd (docs/coordination.md).

``etcd``: the client of etcd's v3 API. ``server``: start and stop a local etcd (tests,
benchmarks, the single-host demo). ``nslog``: the scope=job namespace as an op log in etcd.
"""
