"""BLEU during training: valid records carry it, the best step is kept through pruning and resume.

The pieces without processes (the best file and pruning, the valid sample, the reasons to
skip, the trainer's state) first; then one short DP=2 run on the built-in corpus and its
resume at TP=2.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from train_helpers import common, losses, ok, train

from megaformer import checkpoint as ckpt
from megaformer.data.tokenizer import EOS_ID, Tokenizer
from megaformer.errors import CheckpointError
from megaformer.train.valid_bleu import _encode, bleu_skip_reason, load_bleu_sample

# ---- without processes -------------------------------------------------------------------------------


def _steps(root: Path) -> list[str]:
    return [p.name for p in ckpt.list_checkpoints(root)]


def test_prune_keeps_the_step_named_best(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 7):
        (root / ckpt.step_dir_name(step)).mkdir(parents=True)
    ckpt.write_best(root, root / ckpt.step_dir_name(2))
    assert (root / "best").read_text() == "step-00000002\n"
    ckpt.prune(root, keep_last=2)
    assert _steps(root) == ["step-00000006", "step-00000005", "step-00000002"]
    ckpt.write_best(root, root / ckpt.step_dir_name(6))  # a newer best: the old one is pruned next time
    ckpt.prune(root, keep_last=1)
    assert _steps(root) == ["step-00000006"]
    (root / "best").write_text("../elsewhere\n")  # not a step name: protects nothing, names nothing
    assert ckpt.read_pointer(root / "best") is None
    with pytest.raises(CheckpointError, match="does not name a step directory"):
        ckpt.resolve_checkpoint(root / "best", log=print)


def test_trainer_state_keeps_best_bleu_and_reads_old_checkpoints():
    from megaformer.train.schedule import Cooldown
    from megaformer.train.trainer import Trainer

    class Engine:  # the engine's cool-down: what an old checkpoint's trainer state still carries
        cooldown = None

        def set_cooldown(self, cooldown):
            self.cooldown = cooldown

    trainer = SimpleNamespace(tokens=5, train_seconds=1.5, best_bleu=12.5, _validated=4, engine=Engine())
    state = Trainer.state_dict(trainer)
    assert state == {"tokens": 5, "train_seconds": 1.5, "best_bleu": 12.5, "validated": 4}  # no cool-down: the engine's
    fresh = SimpleNamespace(best_bleu=None, _validated=-1, engine=Engine())
    Trainer.load_state_dict(fresh, json.loads(json.dumps(state)))  # meta.json holds it as JSON
    assert fresh.best_bleu == 12.5 and fresh.tokens == 5 and fresh.engine.cooldown is None and fresh._validated == 4
    Trainer.load_state_dict(fresh, {"tokens": 7, "train_seconds": 2.0})  # written before BLEU was tracked
    assert fresh.best_bleu is None and fresh.tokens == 7 and fresh._validated == -1  # nor the last step validated
    Trainer.load_state_dict(fresh, {**state, "cooldown": [40, 10]})  # written when the trainer held the cool-down
    assert fresh.engine.cooldown == Cooldown(40, 10)


def test_reasons_to_skip_bleu():
    assert bleu_skip_reason(200, True, 1, False) is None
    assert "eval_bleu_sentences=0" in bleu_skip_reason(0, True, 1, False)
    assert "no valid split" in bleu_skip_reason(200, False, 1, False)
    assert "pipeline stages" in bleu_skip_reason(200, True, 2, False)
    assert "sequence parallelism" in bleu_skip_reason(200, True, 1, True)


def test_valid_sample_from_raw_text_and_from_shards(corpus, tmp_path):
    manifest = json.loads((corpus / "manifest.json").read_text())
    raw = manifest["splits"]["valid"]["raw"]
    sample = load_bleu_sample(corpus, 5, 256)
    assert sample.references == (corpus / raw["ref"]).read_text().splitlines()[:5]
    assert all(s[-1] == EOS_ID and len(s) > 1 for s in sample.sources)
    # A prepared directory without raw text: the shards' ids, references decoded by the tokenizer.
    copy = tmp_path / "data"
    subprocess.run(["cp", "-r", str(corpus), str(copy)], check=True)
    del manifest["splits"]["valid"]["raw"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    from_ids = load_bleu_sample(copy, 5, 256)
    assert from_ids.sources == sample.sources and from_ids.references == sample.references
    assert len(load_bleu_sample(corpus, 10**6, 256).sources) == manifest["splits"]["valid"]["samples"]
    tok = Tokenizer(corpus / manifest["tokenizer"]["file"])
    long = _encode(tok, " ".join(["tas nalipe perape"] * 100), 10)
    assert len(long) == 10 and long[-1] == EOS_ID and _encode(tok, "  ", 10) == []


# ---- a run and its resume ----------------------------------------------------------------------------------


def _valid(run: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["kind"] == "valid"}


def _first_best(valid: dict[int, dict]) -> int:
    top = max(r["bleu"] for r in valid.values())
    return min(s for s, r in valid.items() if r["bleu"] == top)


def _meta(run: Path, name: str) -> dict:
    return json.loads((run / "checkpoints" / name / "meta.json").read_text())


def test_bleu_is_logged_and_the_best_step_survives_pruning_and_resume(corpus, tmp_path):
    run = tmp_path / "run"
    sets = common(corpus) + [
        "train.eval_interval=4",
        "train.eval_bleu_sentences=16",  # 8 a replica: an untrained model decodes to the length limit
        "train.save_interval=0",  # only the end, and the best steps
        "train.keep_last=1",
    ]
    proc = train(run, 2, sets + ["train.max_steps=12"])  # DP=2: each replica decodes half, gathered
    ok(proc)
    assert "validation BLEU on 16 sentences" in proc.stdout and "| bleu " in proc.stdout
    valid = _valid(run)
    assert sorted(valid) == [4, 8, 12]
    assert all(0.0 <= r["bleu"] <= 100.0 and 0.0 <= r["bleu_lc"] <= 100.0 for r in valid.values())
    best = ckpt.step_dir_name(_first_best(valid))
    assert (run / "checkpoints" / "best").read_text().strip() == best
    assert set(_steps(run / "checkpoints")) == {"step-00000012", best}  # keep_last=1 kept the best too
    top = max(r["bleu"] for r in valid.values())
    assert _meta(run, best)["run"]["trainer"]["best_bleu"] == top
    assert _meta(run, best)["reason"] == ("schedule" if best == "step-00000012" else "best")
    from megaformer.decode.loading import load_model_file

    assert load_model_file(run / "checkpoints" / "best").meta["step"] == int(best[5:])

    # Resumed at TP=2 (the replica's two ranks decode together): the best BLEU so far is kept.
    proc = train(run, 2, sets + ["train.max_steps=16", "parallel.tp=2"])
    ok(proc)
    valid = _valid(run)
    assert sorted(valid) == [4, 8, 12, 16] and max(losses(run)) == 16
    assert _meta(run, "step-00000016")["run"]["trainer"]["best_bleu"] == max(r["bleu"] for r in valid.values())
    best = ckpt.step_dir_name(_first_best(valid))  # step 16 only if it beat the earlier best
    assert (run / "checkpoints" / "best").read_text().strip() == best
    assert set(_steps(run / "checkpoints")) == {"step-00000016", best}


def test_a_pipeline_validates_without_bleu_and_says_why(corpus, tmp_path):
    run = tmp_path / "run"
    sets = common(corpus) + ["parallel.pp=2", "train.max_steps=2", "train.eval_interval=2", "train.save_interval=0"]
    proc = train(run, 2, sets)
    ok(proc)
    assert proc.stdout.count("validation BLEU off: parallel.pp=2: greedy decoding through pipeline stages") == 1
    assert [sorted(r) for r in _valid(run).values()] == [["kind", "loss", "nll", "ppl", "step", "tokens"]]
    assert not (run / "checkpoints" / "best").exists()
