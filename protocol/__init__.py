"""The bottom layer: the typed messages that cross between packages (a replica's load report,
a streamed token event), the clocks injected into policies, the base error and the registry
of named choices. Every package may import it; it imports none of ours, so `replica` and
`router` can share these types without importing each other."""
