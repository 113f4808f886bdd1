"""``kvtier replay``: replay request traces through the tier hierarchy with kvtier's policies.

The simulator drives the very same policy objects the daemon's store uses
(:mod:`kvtier.policy`), so a table printed here predicts what the daemon does.
"""
