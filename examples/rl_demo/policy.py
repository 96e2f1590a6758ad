"""The policy, the task and the RL arithmetic of the demo (no processes, no refitd here).

* the policy: a tiny transformers 5.x Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``: a Gated DeltaNet layer
  and a gated full-attention layer, 8 routed experts and a shared expert each), random init, a
  64-token vocabulary;
* the task: prompts of random tokens; a response earns the fraction of its tokens that fall in the
  first quarter of the vocabulary (``reward``), so the policy has something to learn from scratch;
* GRPO: group-relative advantages (``advantages``), the on-policy token-level loss (``grpo_loss``);
* NeMo-RL's ``gen_kl_error`` (``gen_kl_sums``): per sampled token, Schulman's k3 estimate
  ``exp(r) - 1 - r`` with ``r = trainer logprob - engine logprob`` (NeMo-RL's ``calculate_kl`` with
  ``logprobs=generation_logprobs``, ``logprobs_reference=prev_logprobs``, its default ``k3``, no
  clamping), averaged over every valid token of the step (its ``masked_mean`` over global tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: the policy's lm_head is scaled by this at init: next-token entropy ~1.6 nats, as a trained LM's,
#: instead of a random init's near-uniform ~4.1 (a wider init of every weight would make the random
#: network itself chaotic: BF16 rounding alone then moves its logits by more than FP8 does here)
HEAD_SCALE = 20.0
#: NeMo-RL's bar for gen_kl_error: above it, rollouts are no longer the trainer's policy
GEN_KL_BAR = 0.004


@dataclass(frozen=True)
class Task:
    prompts: int = 8  # prompt groups a step (split across the trainer ranks)
    group: int = 4  # responses sampled per prompt (GRPO's group)
    prompt_len: int = 4
    response_len: int = 8

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


def config(vocab: int = 64, model: str = "qwen3_5_moe"):
    """The policy's transformers config (checkpoint dtype BF16, as an RL checkpoint is held; head
    dimension 64: vLLM's CPU attention takes no smaller);
    ``model="qwen3_moe"``: a Qwen3-MoE of the same sizes (the reference engine does not hold it)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig

    if model == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            dtype="bfloat16",
        )  # fmt: skip
        cfg.architectures = ["Qwen3MoeForCausalLM"]
        return cfg

    cfg = Qwen3_5MoeTextConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        dtype="bfloat16",
    )  # fmt: skip
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]  # config.json names it: vLLM picks its model class by it
    return cfg


def build_policy(vocab: int = 64, seed: int = 0, model: str = "qwen3_5_moe") -> torch.nn.Module:
    """The policy in FP32 (the trainer's master weights), the same on every rank for one seed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(vocab, model)).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return model


def prompts(task: Task, vocab: int, step: int, seed: int = 0) -> torch.Tensor:
    """``[task.prompts, prompt_len]`` random prompts of ``step``."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randint(0, vocab, (task.prompts, task.prompt_len), generator=g)


def reward(responses: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per response: the fraction of its tokens in the first quarter of the vocabulary."""
    return (responses < vocab // 4).float().mean(-1)


def advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: each response's reward less its group's mean, over the group's std (0 where flat)."""
    r = rewards.view(-1, group)
    adv = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)
    return adv.reshape(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probabilities (float32) of the response tokens of ``tokens`` ``[B, T]`` under ``logits``
    ``[B, T, V]`` (the logits at position t predict token t + 1)."""
    lp = torch.log_softmax(logits[:, prompt_len - 1 : -1].float(), -1)
    return lp.gather(-1, tokens[:, prompt_len:].unsqueeze(-1)).squeeze(-1)


def gen_kl_sums(trainer_lp: torch.Tensor, engine_lp: torch.Tensor) -> tuple[float, float, int]:
    """(sum of k3, sum of trainer minus engine logprob, tokens) over the sampled tokens: a step's
    ``gen_kl_error`` is the first summed over ranks over the tokens summed over ranks."""
    r = trainer_lp.detach().double() - engine_lp.double()
    return float((r.exp() - 1 - r).sum()), float(r.sum()), r.numel()


def grpo_loss(trainer_lp: torch.Tensor, adv: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """The on-policy GRPO objective (one update per batch: the ratio is 1, its gradient the policy
    gradient), a token-level mean over every rank's tokens (``total_tokens``), negated."""
    ratio = (trainer_lp - trainer_lp.detach()).exp()
    return -(adv.unsqueeze(-1) * ratio).sum() / total_tokens


def sample(forward, prompt_ids: torch.Tensor, task: Task, seed: int) -> dict[str, Any]:
    """Sample ``task.group`` responses per prompt with ``forward(ids) -> logits [B, T, V]`` (the
    engine's, whole sequences), at temperature 1 (the trainer's distribution): ``tokens [B*group,
    seq_len]`` and the engine's logprobs of the sampled tokens ``[B*group, response_len]``."""
    g = torch.Generator().manual_seed(seed)
    ids = prompt_ids.repeat_interleave(task.group, 0)
    lps = []
    for _ in range(task.response_len):
        logits = forward(ids)[:, -1].float()
        logp = torch.log_softmax(logits, -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=g)
        lps.append(logp.gather(-1, nxt))
        ids = torch.cat([ids, nxt], 1)
    return {"tokens": ids, "engine_lp": torch.cat(lps, 1)}
