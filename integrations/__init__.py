"""Framework glue: refitd chosen in one line of an RL framework's config.

* :mod:`integrations.verl`: a ``refitd`` backend in verl's ``CheckpointEngineRegistry`` (name the
  module as ``rollout.checkpoint_engine.custom_backend_module``), the checkpoint manager that loads
  rollout replicas through refitd's engine adapters (``rollout.checkpoint_manager_class``), and the
  vLLM worker extension those replicas run.
* :mod:`integrations.nemo_rl`: a NeMo-RL weight transport (``policy.generation.refit_transport``);
  :mod:`integrations.nemo_rl_vllm` its vLLM side (loads inside NeMo-RL's vLLM worker through
  refitd's vLLM adapter; ``python -m integrations.nemo_rl_vllm`` writes the engine's config).

Each module imports its framework when it is imported itself, never from here: refitd installs and
imports without any framework. They import only refitd's client (``sidecar.client``) and engine
adapters (``adapters``), never the daemon. ``docs/frameworks.md`` has the config lines per framework.
"""
