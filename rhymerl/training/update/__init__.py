"""The update room: the policy trainer (trainer), its ranks (rank, trainer_group, token_balance),
advantages before the update (advantage), the update streamed over groups as they land (stream), and heads trained beside the policy
(online_head, draft_head_trainer, eagle3_trainer)."""
from rhymerl.training.update.advantage import advantages
from rhymerl.training.update.stream import finish_prompt_split, streamed_update_for
from rhymerl.training.update.trainer import Experience, PolicyTrainer, sampling_token_logp
from rhymerl.training.update.trainer_group import TrainerGroup, TrainerRankError
