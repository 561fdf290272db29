"""An example plait plugin: the entry point ``example`` in the group ``plait`` names this module."""

from core.api import hookimpl
from plait_example_plugin.compressed_ddp import DDPFP16, DDPFP16Options
from plait_example_plugin.lion import Lion, LionOptions
from plait_example_plugin.loss_target import LossTarget, LossTargetOptions
from plait_example_plugin.repeat_data import Repeat, RepeatOptions
from plait_example_plugin.step_schedule import StepDecay, StepDecayOptions
from plait_example_plugin.tf32 import TF32, TF32Options
from plait_example_plugin.tiny_gpt import TinyGPT, TinyGPTOptions


@hookimpl
def plait_register(registry):
    registry.add("optimizer", "lion", Lion, options=LionOptions, doc="Lion: sign of interpolated momentum (Chen et al. 2023)")
    registry.add("model", "tiny_gpt", TinyGPT, options=TinyGPTOptions, doc="a GPT-2 style model with tied embeddings")
    registry.add("data", "repeat", Repeat, options=RepeatOptions, doc="synthetic runs of consecutive ids (predictable next token)")
    registry.add("lr_schedule", "step_decay", StepDecay, options=StepDecayOptions, doc="multiply the LR by gamma every n steps")
    registry.add("monitor", "loss_target", LossTarget, options=LossTargetOptions, doc="stop with a checkpoint once the loss is below a target")
    registry.add("parallelism", "ddp_fp16", DDPFP16, options=DDPFP16Options, doc="DDP with float16 gradient all-reduce (half the bytes)")
    registry.add("precision", "tf32", TF32, options=TF32Options, doc="fp32 with TensorFloat-32 matmuls on NVIDIA GPUs")
