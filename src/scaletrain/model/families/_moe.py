"""What the three mixtures of experts share (Mixtral, Qwen3-MoE, OLMoE): each routes by a softmax
over experts, keeps the top k and runs every token (dropless), as ours does with moe_score=softmax
and no capacity. None has a routing bias, so the import turns ours off (model.moe_bias_rate=0: a
bias learned in fine-tuning could not be exported). `router_aux_loss_coef` is not carried over:
transformers' load-balancing loss pools the whole batch and all layers into one product, ours
(model.moe_aux_loss) is the Switch loss of each layer and each sequence."""

from __future__ import annotations

from typing import Any, ClassVar

from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import Reader, Refuse, RotaryFamily, short


class MoeFamily(RotaryFamily):
    """A rotary family whose MLPs are (some or all of them) mixtures of experts."""

    # the config keys that count the experts, the one its own class writes first
    expert_count_keys: ClassVar[tuple[str, str]] = ("num_local_experts", "num_experts")

    def renorm(self, get: Reader) -> bool:
        """Whether the chosen experts' weights are rescaled to sum to one (model.moe_renorm)."""
        return get.bool("norm_topk_prob")

    def moe_fields(self, get: Reader, refuse: Refuse, n_layers: int) -> dict[str, Any]:
        """Experts, top k, renormalisation (and where a family says so, expert width and which
        blocks hold experts)."""
        names = self.expert_count_keys
        given = [k for k in names if k in get.hf]
        if len(given) == 2 and get.hf[names[0]] != get.hf[names[1]]:
            refuse(names[1], f"differs from {names[0]}={short(get.hf[names[0]])}; they name the same count of experts")
        experts = get.int(given[0] if given else next(k for k in names if k in get.defaults))
        out: dict[str, Any] = dict(moe_experts=experts, moe_top_k=get.int("num_experts_per_tok"),
                                   moe_renorm=self.renorm(get), moe_score="softmax", moe_bias_rate=0.0)
        self.router_checks(get, refuse)
        return self.moe_blocks(get, refuse, out, n_layers)

    def router_checks(self, get: Reader, refuse: Refuse) -> None:
        """Refuse what the family's router does that ours does not."""

    def moe_blocks(self, get: Reader, refuse: Refuse, out: dict[str, Any], n_layers: int) -> dict[str, Any]:
        """`out` with the blocks that hold experts (every one unless the family says otherwise), or {}
        for a dense model."""
        return out if out["moe_experts"] else {}

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        # router_aux_loss_coef is left to transformers' default: its loss is not ours (see above)
        out.update(num_experts_per_tok=cfg.moe_top_k, output_router_logits=False)
