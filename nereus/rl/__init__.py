"""nereus.rl: the RL math and one step of PPO, GRPO and ReMax over the ``ModelStages``
interface: advantages, losses, rollouts and the algorithms' step functions.

Layers used: nereus.data (tasks, samples, tokenizers). The running job that drives
these steps on model-stages is ``nereus.job``; see each module's docstring for its
contract.
"""

from nereus.rl.advantages import (
    broadcast_to_tokens,
    gae,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    masked_whiten,
    remax_advantages,
    token_rewards,
)
from nereus.rl.algorithms import (
    ALGORITHMS,
    AlgorithmConfig,
    StepContext,
    grpo_step,
    ppo_step,
    remax_step,
)
from nereus.rl.async_buffer import AsyncLedger, Group
from nereus.rl.decoupled import decoupled_policy_loss, decoupled_policy_objective
from nereus.rl.losses import (
    clipped_policy_objective,
    clipped_value_objective,
    policy_loss,
    value_loss,
)
from nereus.rl.mode import RLModeConfig
from nereus.rl.rollout import Rollouts, SamplingConfig, to_batch
from nereus.rl.stages import ModelStages, last_token_scores

__all__ = [
    "ALGORITHMS",
    "AlgorithmConfig",
    "AsyncLedger",
    "Group",
    "RLModeConfig",
    "decoupled_policy_loss",
    "decoupled_policy_objective",
    "ModelStages",
    "Rollouts",
    "SamplingConfig",
    "StepContext",
    "broadcast_to_tokens",
    "clipped_policy_objective",
    "clipped_value_objective",
    "gae",
    "grpo_advantages",
    "grpo_step",
    "kl_estimate",
    "last_token_scores",
    "masked_mean",
    "masked_whiten",
    "policy_loss",
    "ppo_step",
    "remax_advantages",
    "remax_step",
    "to_batch",
    "token_rewards",
    "value_loss",
]
