"""Create or update the Prometheus data source and the dashboard on a Grafana server, through
its HTTP API with `grafana-client`: `GET /api/datasources/uid/:uid`, then `PUT` there or `POST
/api/datasources`, then `POST /api/dashboards/db` with `overwrite`. Pushing twice updates in
place (fixed uids)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException

from dashboards.build import DASHBOARD_FILE, DATASOURCE_NAME, DATASOURCE_UID, DEFAULT_PROMETHEUS, SCRAPE_INTERVAL
from protocol.errors import SlotServeError


class GrafanaPushError(SlotServeError):
    """Grafana refused a request or could not be reached (the step and Grafana's answer are named)."""


@dataclass
class PushResult:
    datasource: str  # "created" or "updated"
    dashboard_url: str
    version: int | None


def datasource(prometheus_url: str) -> dict:
    return {
        "uid": DATASOURCE_UID,
        "name": DATASOURCE_NAME,
        "type": "prometheus",
        "access": "proxy",
        "url": prometheus_url,
        "isDefault": False,
        "jsonData": {"timeInterval": SCRAPE_INTERVAL},
    }


def bound_dashboard(dashboard: dict) -> dict:
    """The dashboard with its data-source variable set to the pushed data source, and no
    numeric id (Grafana matches on uid)."""
    dashboard = copy.deepcopy(dashboard)
    dashboard.pop("id", None)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "datasource":
            variable["current"] = {"text": DATASOURCE_NAME, "value": DATASOURCE_UID}
    return dashboard


def push(
    grafana_url: str,
    token: str | None = None,
    prometheus_url: str = DEFAULT_PROMETHEUS,
    dashboard_file: Path = DASHBOARD_FILE,
    timeout: float = 10.0,
) -> PushResult:
    """`token`: a service-account token (sent as `Authorization: Bearer`); without one, a
    `user:password@` in the URL is sent as basic auth."""
    api = GrafanaApi.from_url(grafana_url, credential=token, timeout=timeout)
    body = datasource(prometheus_url)
    try:
        try:
            api.datasource.get_datasource_by_uid(DATASOURCE_UID)
            exists = True
        except GrafanaClientError as err:
            if err.status_code != 404:
                raise
            exists = False
        if exists:
            api.datasource.update_datasource_by_uid(DATASOURCE_UID, body)
        else:
            api.datasource.create_datasource(body)
        dashboard = bound_dashboard(json.loads(Path(dashboard_file).read_text()))
        answer = api.dashboard.update_dashboard(
            {"dashboard": dashboard, "overwrite": True, "message": "slotserve dashboard push"}
        )
    except GrafanaException as err:
        raise GrafanaPushError(f"Grafana at {grafana_url} refused the push: {err}") from None
    except OSError as err:  # connection refused, DNS, timeout
        raise GrafanaPushError(f"cannot reach Grafana at {grafana_url}: {err}") from None
    return PushResult("updated" if exists else "created", answer.get("url", ""), answer.get("version"))
