"""Communication per rank and optimizer step: bytes per mesh dimension and collective, and their time.

Byte accounting follows the ZeRO paper (Rajbhandari et al. 2020, Sec. 7), the same as
lightning-para's comm tracer: an all-reduce of ``M`` bytes counts ``2M`` (reduce-scatter plus
all-gather), a reduce-scatter its full input, an all-gather its full output, an all-to-all its
input, point-to-point the bytes sent plus received. What actually leaves a rank of an
``n``-rank ring is ``(n-1)/n`` of that (``wire_bytes``).

Time is the alpha-beta model (Hockney 1994) of ring collectives (NCCL's algorithm for
reduce-scatter and all-gather; Thakur et al. 2005 for the step counts): an all-reduce takes
``2(n-1)`` steps, reduce-scatter / all-gather / all-to-all ``n-1``, each paying the hop
latency, plus ``wire_bytes / bandwidth``. A group whose ranks span more than one node runs at
the inter-node bandwidth (see :meth:`Layout.group` for the mesh order).

What each dimension sends (per microbatch unless stated; ``X = (s/cp) b h e`` one activation):

* ``tp`` (Megatron-LM, Shoeybi et al. 2019, Sec. 3): 2 all-reduces of ``X`` per layer forward,
  2 backward; with SP each is an all-gather plus a reduce-scatter (Korthikanti et al. 2022,
  Sec. 4.2.2, same volume), and backward all-gathers the two saved input shards again. Full
  recomputation repeats the forward ones. The vocab-parallel embedding and output head add one
  each (all-reduce, or all-gather + reduce-scatter with SP).
* ``pp``: one activation (``X / t`` with SP) per chunk boundary forward, one gradient backward.
* ``ep`` (GShard, Lepikhin et al. 2020, Sec. 3.2): per MoE layer, all-to-all dispatch and
  combine of ``top_k * capacity`` copies of each token, forward and backward (4; 6 with full
  recomputation).
* ``cp``, ring attention (Liu et al. 2023; ``parallel/context/ring.py``): per layer, ``cp - 1``
  K/V block exchanges forward and again backward, plus ``cp`` hops of the fp32 dK/dV
  accumulators (one more than K/V: the last hop brings a block's gradient home). Ulysses
  (Jacobs et al. 2023; ``cp_method="all_to_all"``): 4 all-to-alls per layer forward (q, k, v,
  output), 4 backward.
* ``dp`` / ``edp`` per step: ZeRO-0 all-reduces gradients (``2 psi``); ZeRO-1/2 reduce-scatter
  gradients and all-gather the updated weights (``2 psi``); ZeRO-3 gathers weights for forward
  and for backward and reduce-scatters gradients (``3 psi``, ZeRO paper Sec. 7.2.2), once per
  step with ``no_sync`` and per microbatch with ``reduce_each_step``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_para.plan.cluster import Cluster

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")
_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "send_recv": lambda n: 1}  # others: n - 1
# A send_recv call is one exchange: a tensor sent to one neighbour and one received from another.
_VOLUME = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "all_to_all": 1.0, "send_recv": 2.0}


@dataclass(frozen=True)
class Collective:
    """One kind of communication of one rank over one optimizer step.

    Attributes:
        dim: mesh dimension (``tp``, ``cp``, ``ep``, ``pp``, ``dp``, ``edp``, ``dp_replicate``).
        op: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all`` or ``send_recv``.
        what: what is sent (e.g. "gradients", "layer activations").
        payload: bytes of the full tensor of one call (for ``send_recv``: of the one tensor sent,
            the same size as the one received).
        calls: calls per optimizer step.
        group_size: ranks in the group.
        crosses_nodes: the group spans more than one node.
        seconds: alpha-beta time of all calls, overlap not considered.
        exposed_seconds: the part on the critical path (filled in by :func:`~lightning_para.plan.cost.estimate`).
    """

    dim: str
    op: str
    what: str
    payload: float
    calls: float
    group_size: int
    crosses_nodes: bool
    seconds: float
    exposed_seconds: float = 0.0

    @property
    def bytes(self) -> float:
        """Bytes per step in the ZeRO paper's / comm tracer's accounting."""
        return _VOLUME[self.op] * self.payload * self.calls

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank puts on the wire per step: ``(n-1)/n`` of :attr:`bytes` for rings."""
        if self.op == "send_recv":
            return self.bytes / 2  # the sent half of send + receive
        return self.bytes * (self.group_size - 1) / self.group_size

    def exposed(self, seconds: float) -> "Collective":
        return replace(self, exposed_seconds=max(0.0, min(seconds, self.seconds)))


def crosses_nodes(group: tuple[int, int], cluster: Cluster) -> bool:
    """Whether a group of ``(size, span)`` (:meth:`Layout.group <lightning_para.plan.layout.Layout.group>`) spans
    more than one node."""
    size, span = group
    return size > 1 and span > cluster.gpus_per_node


def collective(
    group: tuple[int, int], cluster: Cluster, dim: str, op: str, what: str, payload: float, calls: float
) -> Collective:
    """A :class:`Collective` over the ``dim`` group of ``(size, span)``, with its alpha-beta time."""
    if op not in OPS:
        raise ValueError(f"`op={op!r}` is unknown. Choose one of {', '.join(map(repr, OPS))}.")
    n = group[0]
    if dim == "pp" or (dim == "cp" and op == "send_recv"):
        n = 2 if n > 1 else 1  # point-to-point: one neighbour
    cross = crosses_nodes(group, cluster)
    bandwidth = cluster.inter_node_bw if cross else cluster.intra_node_bw
    latency = cluster.inter_node_latency if cross else cluster.intra_node_latency
    item = Collective(dim, op, what, float(payload), float(calls), n, cross, 0.0)
    steps = _STEPS.get(op, lambda k: k - 1)(n)
    seconds = calls * steps * latency + item.wire_bytes / bandwidth if n > 1 else 0.0
    return replace(item, seconds=seconds)


def per_call_seconds(item: Collective) -> float:
    """Time of one call of ``item``."""
    return item.seconds / item.calls if item.calls else 0.0
