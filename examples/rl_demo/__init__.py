"""``make rl-demo``: a tiny GRPO loop on CPU whose rollouts come from an engine that refitd refits
every step, in each expert format, logging how far the engine's sampling stays from the trainer's
policy (NeMo-RL's ``gen_kl_error``). See :mod:`examples.rl_demo.run`."""
