"""``make rl-demo``'s pieces: NeMo-RL's gen_kl_error and the GRPO arithmetic on hand-made numbers, and
one whole GRPO step (a real ``refitd serve``, two FSDP2 trainer ranks, the reference engine holding
block-FP8 experts) whose trainer-vs-engine KL is measured and stays under NeMo-RL's bar."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="the test extra: pip install -e '.[test]'")

from examples.rl_demo import policy, report, run


def test_gen_kl_error_is_nemo_rls_k3_of_trainer_over_engine():
    trainer = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    engine = torch.tensor([[-1.2, -2.0], [-0.4, -2.5]])
    k3, diff, n = policy.gen_kl_sums(trainer, engine)
    r = [0.2, 0.0, -0.1, -0.5]  # trainer - engine: NeMo-RL's logr = prev_logprobs - generation_logprobs
    assert n == 4
    assert k3 == pytest.approx(sum(math.exp(x) - 1 - x for x in r))
    assert diff == pytest.approx(sum(r))
    assert policy.gen_kl_sums(trainer, trainer)[0] == 0.0  # the same policy: no error


def test_logprobs_are_read_at_the_sampled_tokens_one_position_back():
    tokens = torch.tensor([[3, 1, 2, 0]])
    logits = torch.full((1, 4, 5), -30.0)
    logits[0, 1, 2] = logits[0, 2, 0] = 30.0  # position t predicts token t + 1
    lp = policy.token_logprobs(logits, tokens, prompt_len=2)
    assert lp.shape == (1, 2) and torch.allclose(lp, torch.zeros(1, 2), atol=1e-6)


def test_group_advantages_and_reward():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    adv = policy.advantages(rewards, group=2)
    assert adv[0] > 0 > adv[1] and adv[2:].abs().max() < 1e-6  # a flat group teaches nothing
    assert policy.reward(torch.tensor([[0, 15, 16, 63]]), vocab=64).tolist() == [0.5]


@pytest.mark.timeout(240)
def test_one_grpo_step_refitted_through_refitd_stays_on_policy(tmp_path, capsys):
    assert run.main(["--formats", "block_fp8", "--steps", "1", "--no-plot", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "rl_demo.json").read_text())["rows"]
    assert [(r["format"], r["step"]) for r in rows] == [("block_fp8", 0)]
    row = rows[0]
    task = policy.Task()
    assert row["tokens"] == task.prompts * task.group * task.response_len
    # the engine sampled from block-FP8 experts, not the trainer's weights: some error, under the bar
    assert 0.0 < row["gen_kl_error"] < policy.GEN_KL_BAR
    # the never-refitted contrast engine holds the same first generation at step 0 (its logprobs come
    # from one forward pass over the whole sequences, the sampler's from one a token: float noise)
    assert row["stale_kl"] == pytest.approx(row["gen_kl_error"], rel=1e-3)
    assert row["refit_s"] > 0 and row["pause_s"] > 0 and 0.0 <= row["reward"] <= 1.0
    assert (tmp_path / "rl_demo.csv").read_text().splitlines()[0] == ",".join(report.COLUMNS)


def test_an_fp8_format_over_the_bar_fails_the_demo():
    rows = [
        {"format": "mxfp8", "engine": "reference", "step": s, "gen_kl_error": kl, "reward": 0.3,
         "refit_s": 0.1, "pause_s": 0.01}
        for s, kl in enumerate([1e-4, 5e-3])
    ]  # fmt: skip
    assert report.over_bar(report.summary(rows)) == ["mxfp8"]
    rows[1]["gen_kl_error"] = 1e-4
    assert report.over_bar(report.summary(rows)) == []
