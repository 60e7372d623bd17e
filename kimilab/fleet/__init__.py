"""A fleet of engine instances: routers (round-robin, least-loaded, prefix and state affinity),
failures, per-tenant isolation, and what a run measured.

* ``routers``  Router and the four policies behind one ``choose`` interface
* ``fleet``    Fleet: N engines on one discrete-event clock; open_fleet, run_fleet
* ``disagg``   DisaggregatedFleet: prefill instances hand each request's context to decode instances
* ``result``   FleetResult: latency percentiles, usable hits, busy time, per tenant and instance
"""

from kimilab.fleet.disagg import DisaggregatedFleet
from kimilab.fleet.fleet import ISOLATION, Fleet, open_fleet, run_fleet
from kimilab.fleet.result import FleetResult
from kimilab.fleet.routers import (ROUTERS, ApproximateTree, CostRouter, LeastLoaded, LeastWork, PrefixAffinity,
                                   RoundRobin, Router, StateAware, make_router)

__all__ = ["ISOLATION", "Fleet", "DisaggregatedFleet", "open_fleet", "run_fleet", "FleetResult", "ROUTERS", "Router", "RoundRobin", "LeastLoaded",
           "PrefixAffinity", "StateAware", "make_router", "LeastWork", "CostRouter", "ApproximateTree"]
