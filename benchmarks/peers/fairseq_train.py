"""fairseq-train under a time budget as megaformer's (run by the fairseq venv's python; see budget.py).

    python fairseq_train.py BUDGET.json SUMMARY.json -- FAIRSEQ-TRAIN ARGS...

Two of fairseq's own functions are replaced for the run, nothing else: the inverse-sqrt scheduler's
``step_update`` takes its lr from :class:`budget.Budget` (the warm-up fitted to the updates the minutes give,
the same peak), and ``fairseq_cli.train.validate_and_save`` saves ``checkpoint_uN.pt`` every minutes/24 of
training and stops when the minutes are spent (validation is off, as it is outside megaformer's training minutes).
After training the last ``average`` checkpoints' models are averaged into ``averaged.pt`` in the save dir, as
fairseq's ``scripts/average_checkpoints.py`` does (that script is not in the installed package), and SUMMARY.json
gets the updates and the training seconds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget import Budget, wrapper_command  # noqa: E402


def install_hooks(budget: Budget) -> None:
    import fairseq_cli.train as fairseq_train
    from fairseq.optim.lr_scheduler.inverse_square_root_schedule import InverseSquareRootSchedule

    def step_update(self, num_updates):
        if num_updates > 0:
            budget.observe(num_updates)
        self.lr = budget.lr(num_updates + 1)  # the lr the next update uses
        self.optimizer.set_lr(self.lr)
        return self.lr

    def validate_and_save(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch):
        updates = trainer.get_num_updates()
        stop = budget.spent()
        if updates > 0 and (budget.save_due() or stop):
            path = os.path.join(cfg.checkpoint.save_dir, f"checkpoint_u{updates:07d}.pt")
            trainer.consolidate_optimizer()  # as fairseq's checkpoint_utils.save_checkpoint does first
            trainer.save_checkpoint(path, {"train_iterator": epoch_itr.state_dict(), "val_loss": None})
        return [None], stop

    InverseSquareRootSchedule.step_update = step_update
    fairseq_train.validate_and_save = validate_and_save


def average(save_dir: Path, last: int) -> tuple[int, list[str]]:
    """Average the models of the last ``last`` saves into save_dir/averaged.pt; (updates of the last, files)."""
    import torch

    saves = sorted(save_dir.glob("checkpoint_u*.pt"))[-last:]
    if not saves:
        raise SystemExit(f"fairseq_train.py: {save_dir} holds no checkpoint_u*.pt: the run saved nothing")
    state = torch.load(saves[-1], map_location="cpu", weights_only=False)
    total = {k: v.double() for k, v in state["model"].items()}
    for path in saves[:-1]:
        for k, v in torch.load(path, map_location="cpu", weights_only=False)["model"].items():
            total[k] += v.double()
    state["model"] = {k: (v / len(saves)).to(state["model"][k].dtype) for k, v in total.items()}
    state["last_optimizer_state"] = None
    torch.save(state, save_dir / "averaged.pt")
    return int(saves[-1].stem.removeprefix("checkpoint_u")), [p.name for p in saves]


def main() -> None:
    spec, summary_file, args = wrapper_command(sys.argv[1:], "FAIRSEQ-TRAIN")
    budget = Budget(spec)
    install_hooks(budget)
    import fairseq_cli.train as fairseq_train

    sys.argv = ["fairseq-train", *args]
    fairseq_train.cli_main()
    seconds = budget.clock()
    save_dir = Path(args[args.index("--save-dir") + 1])
    updates, files = average(save_dir, spec["average"])
    summary = {"updates": updates, "train_seconds": seconds, "warmup": budget.warmup, "averaged": files}
    Path(summary_file).write_text(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
