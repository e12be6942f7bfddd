"""The cluster around the engines: the `slotserve` CLI, the client, the driver that replays
workloads, deployment on Ray, the metrics store and its goodput report, the metric
definitions, and the in-process policy comparison.

`cluster` uses `replica`, `router` and `workloads`; none of them imports it."""
