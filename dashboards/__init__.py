"""Grafana dashboards for a running slotserve cluster, generated from Python.

`panels` holds every panel's PromQL (the one source), `build` writes the Grafana JSON, the
provisioning files and the Prometheus scrape configuration into this folder, `queries` reads a
dashboard JSON back into the PromQL it runs, `prometheus` is a small client of Prometheus's
HTTP API, `render` draws the panels as PNG and `push` sends them to a Grafana server."""
