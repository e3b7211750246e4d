"""The fleet router core (sans-IO, docs/fleet.md): which prefill, relay and
main decode serve a request, from a registry view."""

from kvbridge.fleet.core import FleetConfig, FleetRoute, FleetRouter, Reroute

__all__ = ["FleetConfig", "FleetRoute", "FleetRouter", "Reroute"]
