"""onmt_train under a time budget as megaformer's (run by the OpenNMT-py venv's python; see budget.py).

    python opennmt_train.py BUDGET.json SUMMARY.json -- ONMT_TRAIN ARGS...

Four of OpenNMT-py's functions are wrapped for the run: the lr schedule (``-learning_rate 1`` times
:meth:`budget.Budget.lr`: the warm-up fitted to the minutes, megaformer's peak), the optimizer's Adam eps
(OpenNMT-py fixes it at 1e-8; megaformer's is set on the built optimizer), the feed-forward network's dropout
after its ReLU (OpenNMT-py applies the residual rate there, no option changes it; the recipe's
``activation_dropout`` is set on it), and the per-step report, after which the wrapper saves every minutes/24
of training and, when the minutes are spent, saves and stops the loop. SUMMARY.json gets the updates, the
training seconds and the saved checkpoints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget import Budget, wrapper_command  # noqa: E402


class Spent(Exception):
    """The minutes are spent: the last checkpoint is saved, the training loop ends here."""


def install_hooks(budget: Budget, eps: float, activation_dropout: float, saved: list[int]) -> None:
    import onmt.trainer
    import onmt.utils.optimizers as optimizers
    from onmt.modules.position_ffn import PositionwiseFeedForward

    init, update = PositionwiseFeedForward.__init__, PositionwiseFeedForward.update_dropout

    def ffn_init(self, *args, **kwargs):  # the dropout after the ReLU: megaformer's activation_dropout
        init(self, *args, **kwargs)
        self.dropout_1.p = activation_dropout

    def ffn_update_dropout(self, dropout):
        update(self, dropout)
        self.dropout_1.p = activation_dropout

    PositionwiseFeedForward.__init__ = ffn_init
    PositionwiseFeedForward.update_dropout = ffn_update_dropout

    optimizers.make_learning_rate_decay_fn = lambda opt: budget.lr
    build = optimizers.build_torch_optimizer

    def build_torch_optimizer(model, opt):
        optimizer = build(model, opt)
        for group in getattr(optimizer, "param_groups", []):
            group["eps"] = eps
        return optimizer

    optimizers.build_torch_optimizer = build_torch_optimizer
    report = onmt.trainer.Trainer._maybe_report_training

    def maybe_report_training(self, step, num_steps, learning_rate, report_stats):
        stats = report(self, step, num_steps, learning_rate, report_stats)
        budget.observe(step)
        spent = budget.spent()
        if budget.save_due() or spent:
            self.model_saver.save(step, moving_average=self.moving_average)
            saved.append(step)
        if spent:
            raise Spent
        return stats

    onmt.trainer.Trainer._maybe_report_training = maybe_report_training


def main() -> None:
    spec, summary_file, args = wrapper_command(sys.argv[1:], "ONMT_TRAIN")
    budget = Budget(spec)
    saved: list[int] = []
    install_hooks(budget, spec["adam_eps"], spec["activation_dropout"], saved)
    import onmt.bin.train

    sys.argv = ["onmt_train", *args]
    try:
        onmt.bin.train.main()
    except Spent:
        pass
    if not saved:
        raise SystemExit("opennmt_train.py: the run saved nothing")
    summary = {"updates": saved[-1], "train_seconds": budget.clock(), "warmup": budget.warmup, "saved": saved}
    Path(summary_file).write_text(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
