"""Transports that move KV bytes between engines (TCP across the WAN, UCX
inside a datacenter)."""
