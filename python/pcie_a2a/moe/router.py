"""The MoE router: scores, (grouped) top-k, weights.

Written from the published semantics of the models' reference code:

* **DeepSeek-V3 / Kimi K2** (``scoring="sigmoid"``, ``correction_bias=True``, grouped):
  ``s = sigmoid(logits)``; selection uses ``s + e_score_correction_bias`` (the bias only
  chooses, it never weights); experts are split into ``n_group`` groups, each group is
  scored by the sum of its two best biased scores, the ``topk_group`` best groups are
  kept and the top-k experts are chosen among them; the weights are the *unbiased* ``s``
  of the chosen experts, renormalised to sum 1 (``renormalize``, with a 1e-20 guard)
  and multiplied by ``routed_scaling_factor``.
* **Qwen3-MoE** (``scoring="softmax"``): softmax over all experts (fp32), top-k, and
  renormalisation when the config's ``norm_topk_prob`` is true.
* **Mixtral** (``scoring="softmax"``, ``renormalize=True``): the reference code takes
  the softmax over the top-k *logits*; softmax over all experts followed by top-k and
  renormalisation is the same function (softmax is monotonic and the normaliser
  cancels), which is what is computed here (equal to within fp32 rounding, tested).

Logits are computed in fp32 (``F.linear(x.float(), weight.float())``) whatever the
activation dtype; the weights returned are fp32 (what :class:`pcie_a2a.Buffer` carries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")


def _fail(kind: type[Exception], arg: str, got: object, allowed: str) -> Exception:
    return kind(f"{arg}: got {got}; allowed: {allowed}")


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _fail(ValueError, name, repr(value), "a positive int")
    return value


class Router(nn.Module):
    """Token -> (top-k expert ids, weights).

    Args:
        hidden: hidden size H.
        num_experts: number of routed experts E (global).
        top_k: experts per token K.
        scoring: ``"softmax"`` or ``"sigmoid"``.
        n_group, topk_group: grouped top-k (DeepSeek-V3): E is split into ``n_group``
            contiguous groups and the top-k is taken among the ``topk_group`` best groups.
            ``None`` (or ``n_group=1``) disables grouping.
        group_score: how a group is ranked: ``"top2_sum"`` (DeepSeek-V3 ``noaux_tc``: sum
            of the group's two best selection scores) or ``"max"`` (DeepSeek-V2
            ``group_limited_greedy``).
        correction_bias: adds the ``e_score_correction_bias [E]`` fp32 buffer, added to
            the scores for selection only.
        renormalize: divide the K weights by their sum (``norm_topk_prob``).
        routed_scaling_factor: multiplies the final weights.
        dtype: dtype of the gate weight ``[E, H]`` (as stored in the checkpoint).

    Attributes: ``weight [E, H]`` (``dtype``), ``e_score_correction_bias [E]`` fp32 or None.
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        scoring: str = "softmax",
        n_group: int | None = None,
        topk_group: int | None = None,
        group_score: str = "top2_sum",
        correction_bias: bool = False,
        renormalize: bool = False,
        routed_scaling_factor: float = 1.0,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        self.hidden = _positive_int("hidden", hidden)
        self.num_experts = _positive_int("num_experts", num_experts)
        self.top_k = _positive_int("top_k", top_k)
        if top_k > num_experts:
            raise _fail(ValueError, "top_k", top_k, f"at most num_experts={num_experts}")
        if scoring not in SCORINGS:
            raise _fail(ValueError, "scoring", repr(scoring), "'softmax', 'sigmoid'")
        if group_score not in GROUP_SCORES:
            raise _fail(ValueError, "group_score", repr(group_score), "'top2_sum', 'max'")
        if (n_group is None) != (topk_group is None):
            raise ValueError(
                f"n_group={n_group!r}, topk_group={topk_group!r}: pass both or neither"
            )
        if n_group is not None:
            _positive_int("n_group", n_group)
            _positive_int("topk_group", topk_group)
            if num_experts % n_group:
                raise _fail(
                    ValueError, "n_group", n_group, f"a divisor of num_experts={num_experts}"
                )
            if topk_group > n_group:
                raise _fail(ValueError, "topk_group", topk_group, f"at most n_group={n_group}")
            per_group = num_experts // n_group
            if group_score == "top2_sum" and per_group < 2 and n_group > 1:
                raise _fail(
                    ValueError,
                    "n_group",
                    n_group,
                    "at most num_experts / 2 with group_score='top2_sum'",
                )
            if top_k > topk_group * per_group:
                raise _fail(
                    ValueError,
                    "top_k",
                    top_k,
                    f"at most topk_group * experts per group = {topk_group * per_group}",
                )
        if not isinstance(routed_scaling_factor, (int, float)) or routed_scaling_factor <= 0:
            raise _fail(
                ValueError,
                "routed_scaling_factor",
                repr(routed_scaling_factor),
                "a positive number",
            )
        self.scoring = scoring
        self.n_group = n_group
        self.topk_group = topk_group
        self.group_score = group_score
        self.renormalize = bool(renormalize)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(
            torch.zeros(num_experts, hidden, dtype=dtype), requires_grad=False
        )
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None

    # ---- presets -------------------------------------------------------------------------
    @classmethod
    def deepseek_v3(
        cls,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        n_group: int = 8,
        topk_group: int = 4,
        routed_scaling_factor: float = 2.5,
        renormalize: bool = True,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Router:
        """DeepSeek-V3 / Kimi K2 (Kimi K2: n_group=1, topk_group=1, factor 2.827)."""
        return cls(
            hidden,
            num_experts,
            top_k,
            scoring="sigmoid",
            n_group=n_group,
            topk_group=topk_group,
            group_score="top2_sum",
            correction_bias=True,
            renormalize=renormalize,
            routed_scaling_factor=routed_scaling_factor,
            dtype=dtype,
        )

    @classmethod
    def qwen3_moe(
        cls,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Router:
        return cls(
            hidden, num_experts, top_k, scoring="softmax", renormalize=norm_topk_prob, dtype=dtype
        )

    @classmethod
    def mixtral(
        cls, hidden: int, num_experts: int, top_k: int, *, dtype: torch.dtype = torch.bfloat16
    ) -> Router:
        return cls(hidden, num_experts, top_k, scoring="softmax", renormalize=True, dtype=dtype)

    # ---- forward -------------------------------------------------------------------------
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` (any float dtype) -> fp32 logits ``[T, E]``."""
        if not isinstance(x, torch.Tensor):
            raise _fail(TypeError, "x", type(x).__name__, "a torch.Tensor")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise _fail(ValueError, "x.shape", tuple(x.shape), f"[num_tokens, {self.hidden}]")
        if not x.is_floating_point():
            raise _fail(TypeError, "x.dtype", x.dtype, "a floating-point dtype")
        return F.linear(x.float(), self.weight.float())

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``logits [T, E]`` -> (``topk_ids [T, K]`` int64, ``topk_weights [T, K]`` fp32).

        Ids are ordered by descending selection score.
        """
        if logits.dim() != 2 or logits.shape[1] != self.num_experts:
            raise _fail(
                ValueError, "logits.shape", tuple(logits.shape), f"[num_tokens, {self.num_experts}]"
            )
        logits = logits.float()
        t, e = logits.shape
        scores = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float().unsqueeze(0)
        if self.n_group is not None and self.n_group > 1 and self.topk_group < self.n_group:
            grouped = choice.view(t, self.n_group, e // self.n_group)
            if self.group_score == "top2_sum":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            mask = torch.zeros(t, self.n_group, dtype=torch.bool, device=logits.device)
            mask.scatter_(1, keep, True)
            mask = mask.unsqueeze(-1).expand(t, self.n_group, e // self.n_group).reshape(t, e)
            choice = choice.masked_fill(~mask, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return ids, weights.contiguous()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (``topk_ids [T, K]`` int64 global ids, ``topk_weights [T, K]`` fp32)."""
        return self.select(self.logits(x))

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"scoring={self.scoring}, n_group={self.n_group}, topk_group={self.topk_group}, "
            f"bias={self.e_score_correction_bias is not None}, "
            f"renormalize={self.renormalize}, scale={self.routed_scaling_factor}"
        )
