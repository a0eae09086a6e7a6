"""nereus.data: what an RL job trains on: synthetic tasks and file datasets (prompts
and ground truth), the global sample order, rule rewards, tokenizers and pretrained
weights.

Layers used: nereus.models (chat templates, tokenizers). See each module's docstring
for its contract.
"""

from nereus.data.filedata import DataConfig, FileRow, FileTask, read_rows
from nereus.data.prompts import PromptDataset
from nereus.data.rewards import RewardInput, exact_reward, load_reward, math_reward
from nereus.data.tasks import TASKS, ArithmeticTask, CountTask, ReverseTask, Sample, Task, make_task
from nereus.data.vocab import Codec, char_tokenizer

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "Codec",
    "CountTask",
    "DataConfig",
    "FileRow",
    "FileTask",
    "PromptDataset",
    "ReverseTask",
    "RewardInput",
    "Sample",
    "Task",
    "char_tokenizer",
    "exact_reward",
    "load_reward",
    "make_task",
    "math_reward",
    "read_rows",
]
