"""Flow control in the pure router: holding while saturated, strict priority between bands,
VTC's fair share within one, token buckets, deadlines, shedding, and the config's errors. A
fake clock, no Ray; every step is followed by `check_invariants()`."""

from __future__ import annotations

import pickle

import pytest

from protocol.clock import FakeClock
from protocol.errors import OverloadedError
from protocol.flow import FlowConfig, FlowConfigError, TenantConfig, UnknownPriorityError
from protocol.messages import LoadReport
from protocol.routing import Released, RouteRequest
from router.router import Router


class Cluster:
    """One replica behind a flow-controlled router; the replica reports an empty queue and
    `free` free slots, so with `queue_depth = 1` it is saturated once `free + 1` requests are
    in flight beyond its report."""

    def __init__(self, free: int = 1, replicas: int = 1, **flow):
        self.clock = FakeClock()
        flow.setdefault("policy", "priority")
        flow.setdefault("saturation", {"queue_depth": 1})
        self.ids = [f"r{i}" for i in range(replicas)]
        self.router = Router(self.ids, clock=self.clock, flow=FlowConfig(**flow))
        self.free, self.n = free, 0
        self.released: list[Released] = []
        for rid in self.ids:
            self.report(rid)

    def report(self, rid: str = "r0") -> None:
        self.router.report(LoadReport(rid, 0, 0, self.free, 4, 10_000, self.clock.now()))
        self.check()

    def submit(self, priority: int = 0, tenant: str = "default", prompt: int = 10, out: int = 10, **kw):
        self.n += 1
        request = RouteRequest(f"q{self.n}", prompt, out, priority=priority, tenant=tenant, **kw)
        decision = self.router.submit(request)
        self.check()
        return request, decision

    def complete(self, request_id: str, output_len: int | None = None) -> None:
        self.router.complete(request_id, output_len=output_len)
        self.check()

    def check(self) -> None:
        self.router.flow.check_invariants()
        self.released += self.router.take_released()


def test_no_holding_when_not_saturated():
    """A request is routed at once while some replica is below its saturation thresholds."""
    c = Cluster(free=2)
    for _ in range(2):
        _, decision = c.submit(priority=2)
        assert decision is not None and decision.replica_id == "r0"
    assert c.router.flow.num_held == 0


def test_strict_priority_between_bands_under_saturation():
    """Saturated, held requests leave by band: every band-0 request before any band-1, then band 2."""
    c = Cluster(free=0)
    first, decision = c.submit()  # in flight beyond the report: saturated from here on
    assert decision is not None
    for band in (2, 1, 2, 0, 1, 0):
        assert c.submit(priority=band)[1] is None
    order, in_flight = [], first.request_id
    for _ in range(6):
        c.complete(in_flight, 10)
        (released,) = c.released
        c.released.clear()
        assert released.decision is not None
        order.append(released.request_id)
        in_flight = released.request_id
    bands = {f"q{i}": b for i, b in zip(range(2, 8), (2, 1, 2, 0, 1, 0))}
    assert [bands[r] for r in order] == [0, 0, 1, 1, 2, 2]
    assert order[0] == "q5" and order[1] == "q7"  # FCFS within a band


def serve_one_at_a_time(c: Cluster, first: str, steps: int, out: dict[str, int]) -> list[str]:
    """Complete the one request in flight `steps` times (its full output), each completion
    releasing the next held one; returns the tenants served in order."""
    served, in_flight = [], first
    for _ in range(steps):
        c.complete(in_flight, out[in_flight])
        (released,) = c.released
        c.released.clear()
        in_flight = released.request_id
        served.append(in_flight)
    return served


def test_vtc_two_backlogged_tenants_stay_within_the_bound():
    """Two tenants backlogged in one band, one sending long prompts: at every dispatch their
    weighted service (prompt x 1 + output x 2) differs by at most 2 x the largest one-request
    cost, VTC's bound (Sheng et al., Theorem: 2 x max(w_p L_in, w_q L_out)) at the router's
    granularity of a whole request."""
    c = Cluster(free=0, policy="vtc")
    first, _ = c.submit(tenant="a")
    out, tenant_of, cost = {first.request_id: 10}, {}, {}
    for _ in range(40):
        for tenant, prompt in (("a", 200), ("b", 20)):
            request, _ = c.submit(tenant=tenant, prompt=prompt, out=10)
            out[request.request_id], tenant_of[request.request_id] = 10, tenant
            cost[request.request_id] = prompt + 2 * 10
    bound = 2 * max(cost.values())
    service = {"a": 0.0, "b": 0.0}
    for rid in serve_one_at_a_time(c, first.request_id, 40, out):
        service[tenant_of[rid]] += cost[rid]
        assert abs(service["a"] - service["b"]) <= bound
    assert service["b"] > 0 and service["a"] > 0


def test_vtc_flooding_tenant_gets_no_more_than_its_share():
    """A tenant with ten times the backlog of another gets no more than its share while both
    are backlogged (within one request's cost): the flood waits, the other is served as if alone."""
    c = Cluster(free=0, policy="vtc")
    first, _ = c.submit(tenant="steady")
    out, tenant_of = {first.request_id: 10}, {}
    for i in range(50):
        request, _ = c.submit(tenant="flood")
        out[request.request_id], tenant_of[request.request_id] = 10, "flood"
        if i % 10 == 0:
            request, _ = c.submit(tenant="steady")
            out[request.request_id], tenant_of[request.request_id] = 10, "steady"
    served = [tenant_of[r] for r in serve_one_at_a_time(c, first.request_id, 10, out)]
    # equal costs: the counters alternate, ties going to the older head; FCFS would serve 1 steady in 10
    assert served.count("steady") >= 4 and served.count("flood") <= served.count("steady") + 2


def test_priority_policy_serves_the_flood_first_come_first_served():
    """Without VTC the same backlog is served in arrival order: the flood's requests came first."""
    c = Cluster(free=0, policy="priority")
    first, _ = c.submit(tenant="steady")
    out, tenant_of = {first.request_id: 10}, {}
    for tenant in ["flood"] * 5 + ["steady"]:
        request, _ = c.submit(tenant=tenant)
        out[request.request_id], tenant_of[request.request_id] = 10, tenant
    served = [tenant_of[r] for r in serve_one_at_a_time(c, first.request_id, 6, out)]
    assert served == ["flood"] * 5 + ["steady"]


def test_returning_tenant_counter_is_lifted_and_banks_no_credit():
    """A tenant that becomes backlogged again starts at the smallest backlogged counter, not
    at the low counter it kept while idle, so it cannot take the next many dispatches."""
    c = Cluster(free=0, policy="vtc")
    first, _ = c.submit(tenant="busy")
    out, tenant_of = {first.request_id: 10}, {}
    for _ in range(12):
        request, _ = c.submit(tenant="busy")
        out[request.request_id], tenant_of[request.request_id] = 10, "busy"
    in_flight = serve_one_at_a_time(c, first.request_id, 6, out)[-1]
    counters = c.router.flow.counters
    assert counters.get("idle", 0.0) == 0.0 and counters["busy"] > 0
    for _ in range(6):
        request, _ = c.submit(tenant="idle")
        out[request.request_id], tenant_of[request.request_id] = 10, "idle"
    assert counters["idle"] == pytest.approx(counters["busy"])
    served = [tenant_of[r] for r in serve_one_at_a_time(c, in_flight, 6, out)]
    assert served.count("idle") == 3 and served.count("busy") == 3


def test_token_bucket_refuses_naming_the_limit_until_it_refills():
    """Over its requests/s limit a tenant is refused at once with an OverloadedError naming the
    limit, its retry_after the time the bucket needs to hold one more request; then admitted."""
    c = Cluster(free=8, tenants={"t": TenantConfig(requests_per_s=2.0, burst=1.0)})
    c.submit(tenant="t")
    c.submit(tenant="t")
    with pytest.raises(OverloadedError, match="requests_per_s limit of 2") as refused:
        c.submit(tenant="t")
    assert refused.value.retry_after == pytest.approx(0.5)
    c.clock.advance(0.5)
    assert c.submit(tenant="t")[1] is not None
    c.submit(tenant="other")  # a tenant the file does not name has no limit


def test_tokens_per_s_counts_prompt_and_max_tokens():
    """The tokens/s bucket charges prompt + max_tokens; the wait is the missing tokens over the rate."""
    c = Cluster(free=8, tenants={"t": TenantConfig(tokens_per_s=100.0)})
    c.submit(tenant="t", prompt=50, out=30)
    with pytest.raises(OverloadedError, match="tokens_per_s limit of 100") as refused:
        c.submit(tenant="t", prompt=50, out=30)
    assert refused.value.retry_after == pytest.approx(0.6)


def test_deadline_refuses_instead_of_serving_late():
    """A held request still waiting at its deadline (or past its band's max_wait) is refused
    with a reason, and never dispatched after it even when a place frees up then."""
    c = Cluster(free=0, max_wait={2: 5.0})
    first, _ = c.submit()
    late, _ = c.submit(deadline=2.0)
    slow, _ = c.submit(priority=2)
    assert c.router.next_tick() == 2.0
    c.clock.advance(2.0)
    c.router.tick()
    c.check()
    (refused,) = c.released
    assert refused.request_id == late.request_id and "deadline" in str(refused.refusal)
    c.released.clear()
    c.clock.advance(3.0)
    c.complete(first.request_id, 10)  # a place frees exactly at the band's max_wait: refused, not served
    (refused,) = c.released
    assert refused.request_id == slow.request_id and refused.decision is None
    assert "max_wait" in str(refused.refusal) and c.router.flow.num_held == 0


def test_shedding_takes_the_newest_of_the_least_urgent_band_with_retry_after():
    """Past max_held the newest request of the least urgent band is refused (the new one itself
    if it is that), with a retry-after from the queues' drain rate."""
    c = Cluster(free=0, max_held=2)
    first, _ = c.submit()
    old_batch, _ = c.submit(priority=2)
    c.submit(priority=0)
    new_batch, decision = c.submit(priority=2)
    assert decision is None
    (shed,) = c.released
    assert shed.request_id == new_batch.request_id and shed.refusal.retry_after > 0
    c.released.clear()
    c.submit(priority=1)
    (shed,) = c.released
    assert shed.request_id == old_batch.request_id and "priority 2 is shed first" in str(shed.refusal)
    assert c.router.flow.held_by_band() == {0: 1, 1: 1, 2: 0}


def test_unknown_priority_is_a_clear_error_naming_the_bands():
    """A priority outside the bands raises UnknownPriorityError (a ValueError, field "priority")
    naming the allowed ones; nothing is held or routed."""
    c = Cluster(free=4)
    with pytest.raises(UnknownPriorityError, match=r"priority: 7 is not a priority band; allowed: 0, 1, 2") as err:
        c.submit(priority=7)
    assert isinstance(err.value, ValueError) and err.value.field == "priority"
    assert pickle.loads(pickle.dumps(err.value)).allowed == [0, 1, 2]
    assert c.router.routed == 0 and c.router.flow.num_held == 0


def test_config_without_tenants_serves_everyone_as_default():
    """A config naming no tenants is valid: any tenant gets weight 1 and no limits."""
    config = FlowConfig(policy="vtc")
    assert config.tenants == {} and config.tenant("anyone") == TenantConfig()
    c = Cluster(free=4, policy="vtc")
    assert c.submit(tenant="anyone")[1] is not None


def test_fcfs_policy_routes_exactly_as_without_flow_control():
    """Policy fcfs holds nothing, even saturated: the same decisions as `route` without a config."""
    clock = FakeClock()
    plain = Router(["r0", "r1"], clock=clock)
    fcfs = Router(["r0", "r1"], clock=clock, flow=FlowConfig(policy="fcfs"))
    for i in range(20):
        request = RouteRequest(f"q{i}", 10, 10)
        assert plain.route(request).replica_id == fcfs.submit(request).replica_id
        fcfs.flow.check_invariants()
    assert fcfs.take_released() == [] and "flow" not in plain.status()


def test_toml_loader_names_the_file_and_the_bad_field(tmp_path):
    """FlowConfig.load reads TOML; a bad value names the file and its dotted field."""
    good = tmp_path / "flow.toml"
    good.write_text('policy = "vtc"\nmax_wait = { 0 = 5.0 }\n[tenants.batch]\ntokens_per_s = 400\n')
    config = FlowConfig.load(good)
    assert config.max_wait == {0: 5.0} and config.tenant("batch").tokens_per_s == 400
    bad = tmp_path / "bad.toml"
    bad.write_text('[tenants.batch]\nweight = "heavy"\n')
    with pytest.raises(FlowConfigError, match=r"bad\.toml: tenants\.batch\.weight: "):
        FlowConfig.load(bad)
    bad.write_text("max_wait = { 5 = 1.0 }\n")
    with pytest.raises(FlowConfigError, match="max_wait names band 5"):
        FlowConfig.load(bad)


def test_released_refusal_crosses_a_process_intact():
    """A Released refusal pickles with its OverloadedError (where, limit, retry_after, detail)."""
    released = Released("q1", refusal=OverloadedError("priority 0 queue", 3, 0.25, "held too long"))
    again = pickle.loads(pickle.dumps(released))
    assert again.refusal.retry_after == 0.25 and str(again.refusal) == str(released.refusal)
    with pytest.raises(ValueError, match="exactly one"):
        Released("q2")


def test_a_request_held_twice_is_an_error_and_its_old_deadline_never_refuses_it_again():
    """A second submit of a held request id is a RoutingError; a request refused at its
    deadline and submitted again is not refused by the old deadline's timer."""
    from router.errors import RoutingError

    c = Cluster(free=0)
    c.submit()
    request, _ = c.submit(deadline=1.0)
    with pytest.raises(RoutingError, match="already held"):
        c.router.submit(request)
    c.clock.advance(1.0)
    c.router.tick()
    c.check()
    assert [r.request_id for r in c.released] == [request.request_id]
    c.released.clear()
    again = RouteRequest(request.request_id, 10, 10, deadline=5.0)
    assert c.router.submit(again) is None
    c.clock.advance(1.0)
    c.router.tick()
    c.check()
    assert c.released == [] and c.router.next_tick() == 5.0


def test_a_request_more_urgent_than_one_running_is_not_held_and_never_passes_the_held():
    """Saturated with a batch request in flight: an urgent one goes at once (its replica's
    scheduler lets it take the batch request's place), another batch one is held; once only
    urgent work runs, a new urgent request is held like the rest, and is released first."""
    c = Cluster(free=0)
    batch, decision = c.submit(priority=2)
    assert decision is not None
    held_batch = c.submit(priority=2)
    assert held_batch[1] is None  # saturated, and nothing less urgent than it runs
    urgent, decision = c.submit(priority=0)
    assert decision is not None and decision.replica_id == "r0"
    c.complete(batch.request_id, 10)
    assert c.released == []  # the urgent one in flight keeps the replica saturated
    held_urgent = c.submit(priority=0)
    assert held_urgent[1] is None  # only band 0 runs now: nothing for it to pass
    assert c.submit(priority=1)[1] is None
    c.complete(urgent.request_id, 10)
    assert [r.request_id for r in c.released] == [held_urgent[0].request_id]


def test_tenants_api_keys_map_to_their_tenant_and_a_shared_key_is_refused():
    """`tenant_keys` maps each tenant's HTTP keys to it; one key given to two tenants is an error."""
    config = FlowConfig(tenants={"a": TenantConfig(api_keys=["k1", "k2"]), "b": TenantConfig(api_keys=["k3"])})
    assert config.tenant_keys() == {"k1": "a", "k2": "a", "k3": "b"}
    with pytest.raises(ValueError, match="share an API key"):
        FlowConfig(tenants={"a": TenantConfig(api_keys=["k"]), "b": TenantConfig(api_keys=["k"])})


def test_the_release_box_forgets_a_withdrawn_request_and_hands_each_release_to_its_client():
    """A withdrawn request is no longer held there (the actor stops ticking for it), and a release
    goes to the client that sent the request, paired with it; one it never held is dropped."""
    from router.release_box import ReleaseBox

    box = ReleaseBox()
    kept, gone = RouteRequest("kept", 8, 8, priority=1, tenant="a"), RouteRequest("gone", 8, 8)
    box.hold(kept, "client-1")
    box.hold(gone, "client-2")
    box.withdraw("gone")
    assert box.num_held == 1
    refusal = OverloadedError("router", 1, 1.0, "shed")
    released = [Released("kept", refusal=refusal), Released("stranger", refusal=refusal)]
    assert [(item.request_id, request.tenant) for item, request in box.put(released)] == [("kept", "a")]
    assert box.num_held == 0
    assert [r.request_id for r in box.take("client-1", timeout=0)] == ["kept"]
    assert box.take("client-2", timeout=0) == []
