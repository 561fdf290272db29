"""Monitors: ``console``, ``jsonl``, ``tensorboard``, ``mfu``, ``memory``, ``update_ratio``, ``budget_guard``, ``downstream``, ``spikes``,
``spike_rehearsal``, ``seq_len_stages``, ``recurrent_moe``, ``mlflow`` and ``wandb``."""

from core.api import hookimpl


@hookimpl
def plait_register(registry):
    from plugins.monitors.budget_guard import BudgetGuard, BudgetGuardOptions
    from plugins.monitors.console import Console, ConsoleOptions
    from plugins.monitors.downstream import Downstream, DownstreamOptions
    from plugins.monitors.jsonl import Jsonl, JsonlOptions
    from plugins.monitors.memory import Memory
    from plugins.monitors.mfu import MFU
    from plugins.monitors.mlflow_logger import MLflowLogger, MLflowOptions
    from plugins.monitors.recurrent_moe import RecurrentMoEMonitor, RecurrentMoEMonitorOptions
    from plugins.monitors.seq_len_stages import SeqLenStages, SeqLenStagesOptions
    from plugins.monitors.spike_rehearsal import SpikeRehearsal, SpikeRehearsalOptions
    from plugins.monitors.spikes import Spikes, SpikesOptions
    from plugins.monitors.tensorboard import TensorBoard, TensorBoardOptions
    from plugins.monitors.update_ratio import UpdateRatio
    from plugins.monitors.wandb_logger import WandbLogger, WandbOptions

    registry.add("monitor", "console", Console, options=ConsoleOptions, doc="one line per log interval on stdout: loss, grad norm, lr, tokens/s, ETA")
    registry.add("monitor", "jsonl", Jsonl, options=JsonlOptions, doc="one JSON object per logged step in <output_dir>/metrics.jsonl")
    registry.add("monitor", "tensorboard", TensorBoard, options=TensorBoardOptions, doc="TensorBoard scalars in <output_dir>/tensorboard")
    registry.add(
        "monitor",
        "downstream",
        Downstream,
        options=DownstreamOptions,
        doc="multiple-choice tasks (eval/<task>/acc, acc_norm) and bits per byte on held-out files, every N steps, over the ranks",
    )
    registry.add("monitor", "mfu", MFU, doc="adds mfu and peak_tflops to log steps: model FLOPs against the device's dense bf16 peak")
    registry.add(
        "monitor",
        "memory",
        Memory,
        doc="adds the largest rank's parameter, gradient and optimizer-state GiB (every device) and the device memory (allocated, reserved, peak; CUDA) to log steps",
    )
    registry.add("monitor", "update_ratio", UpdateRatio, doc="adds ||update|| / ||parameters|| per parameter group to log steps")
    registry.add(
        "monitor",
        "budget_guard",
        BudgetGuard,
        options=BudgetGuardOptions,
        doc="dollar budget: alert, checkpoint-and-stop on projected overrun, hard stop over the cap",
    )
    registry.add(
        "monitor", "spikes", Spikes, options=SpikesOptions, doc="loss and grad-norm spikes against a rolling window: log, skip the update, or roll back"
    )
    registry.add(
        "monitor",
        "spike_rehearsal",
        SpikeRehearsal,
        options=SpikeRehearsalOptions,
        doc="rehearsal: rare-token batches for a few steps from at_step on, to test spike handling",
    )
    registry.add(
        "monitor",
        "seq_len_stages",
        SeqLenStages,
        options=SeqLenStagesOptions,
        doc="sequence-length stages: shorter sequences early, longer later, tokens per step kept",
    )
    registry.add(
        "monitor",
        "recurrent_moe",
        RecurrentMoEMonitor,
        options=RecurrentMoEMonitorOptions,
        doc="looped MoE health: loop drift, expert collapse, load imbalance, dead experts",
    )
    registry.add("monitor", "mlflow", MLflowLogger, options=MLflowOptions, doc="metrics and config to MLflow (local file store by default; extra 'mlflow')")
    registry.add("monitor", "wandb", WandbLogger, options=WandbOptions, doc="metrics and config to Weights & Biases (offline by default; extra 'wandb')")
