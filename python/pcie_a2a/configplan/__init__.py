"""``pcie-a2a plan``: which parallel configuration and which flags, for a model on a box.

The package is ``pcie_a2a.configplan`` (``pcie_a2a.plan_transfers`` is the topology planner's
function, re-exported at the top level since before this package existed).
"""
