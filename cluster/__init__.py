"""The Ray runtime, and nothing else: deploying the store, replicas and router as actors
(`deploy`), the Python client (`client`, with `connection`, `streams`, `placement` and
`loop_thread` behind it), the driver that replays a workload through a running cluster
(`driver`, on the schedule `pacing` keeps) and the store's actor (`store_actor`).

`cluster` uses `replica`, `router`, `workloads`, `metrics` and `protocol`; none of them imports it."""
