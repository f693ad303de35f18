"""Expert parallelism across nodes: hierarchical dispatch and combine.

Inside a node the rows move through pcie_a2a's own transport (a Buffer over the node's
ranks); between nodes through torch.distributed (gloo on the CPU backend) over "rails", the
groups of ranks with the same local index. A token crosses to another node once per
destination node, to the rank of its own local index there, which scatters it inside its
node; the combine reduces inside the node first and crosses back once, in fp32.
``pcie_a2a.Buffer(group, ...)`` returns an :class:`InternodeBuffer` when ``group`` spans more
than one node (:func:`nodes_of_group`), so callers use the one API.
"""

from pcie_a2a.internode.nodes import NodeLayout, find_nodes, nodes_of_group

__all__ = ["NodeLayout", "find_nodes", "nodes_of_group"]
