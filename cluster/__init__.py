"""The Ray runtime, and nothing else: deploying the store, replicas and router as actors
(`deploy`), the Python client (`client`), the driver that replays a workload through a
running cluster (`driver`) and the store's actor (`store_actor`).

`cluster` uses `replica`, `router`, `workloads`, `metrics` and `protocol`; none of them imports it."""
