"""Settings a run is given that nothing in it reads, each with why: the trainer names them in one line.

A setting accepted and ignored looks like one that worked (sequence parallelism at tp=1,
a warm-up fitted to a time limit the run does not have): the log says which are idle, so
that a user who meant them sees what else to set.
"""

from __future__ import annotations

from megaformer.config import Config, DataConfig, TrainConfig


def settings_without_effect(cfg: Config, data_vocab_size: int) -> list[str]:
    """Each setting of ``cfg`` that does nothing in its run, as "key=value (why)"; ``data_vocab_size``: the data's."""
    t, p, idle = cfg.train, cfg.parallel, []
    if p.sequence_parallel and p.tp == 1:
        idle.append("parallel.sequence_parallel=true (tp=1: no TP ranks to split the sequence over)")
    if t.warmup_fraction and not t.max_minutes:
        idle.append(
            f"train.warmup_fraction={t.warmup_fraction:g} (it fits the warm-up to train.max_minutes, which is 0)"
        )
    if t.zero_overlap_comm and (t.zero_stage == 0 or (t.zero_stage == 1 and t.precision == "bf16")):
        why = (
            "no ZeRO optimizer at train.zero_stage=0"
            if t.zero_stage == 0
            else "bf16 at ZeRO-1 runs DeepSpeed's BF16 optimizer"
        )
        idle.append(f"train.zero_overlap_comm=true ({why}, which reduces gradients without it)")
    if t.profile_steps != TrainConfig.profile_steps and not t.profile_from:
        idle.append(f"train.profile_steps={t.profile_steps} (no profile: train.profile_from=0)")
    if cfg.data.vocab_size not in (DataConfig.vocab_size, data_vocab_size):  # the default is for data-less commands
        idle.append(
            f"data.vocab_size={cfg.data.vocab_size} (the prepared data's tokenizer has {data_vocab_size:,} pieces)"
        )
    return idle
