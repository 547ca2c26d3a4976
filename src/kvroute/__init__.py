"""kvroute: where should a router send each turn of a multi-turn chat?

The package simulates (``kvroute.sim``) and measures (``kvroute.live``) routing
policies (``kvroute.policies``) over multi-turn chat traces (``kvroute.workload``)
and writes one record schema (``kvroute.records``) for both worlds.
"""

__version__ = "0.1.0"
