"""The daemon's settings by what they govern, one dataclass each; :class:`DaemonConfig` joins them.

identity (sockets, keys, wire limits) · formats · memory (arenas, GPUs) · timeouts · layouts
(ranks, node shares, forwarding) · ops (logs, metrics, timelines). A new setting is a field in the
group it belongs to (its ``knob`` metadata gives the flag, converter, help and example); the file key,
``REFITD_*`` variable and flag follow from it.
"""
