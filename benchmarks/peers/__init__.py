"""Adapters that let peer tools train on the same data as eagle3kit, for benchmarks only (nothing in
``eagle3kit`` imports them). :mod:`benchmarks.peers.specforge_adapter`: SpecForge 0.2.0's offline
EAGLE-3 trainer."""
