"""MemctlCallback in a real ``transformers.Trainer`` on CPU: a tiny random-init GPT-2, no download."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

# Skips saying why: the extra is missing, or transformers fails to import (a broken torchvision).
pytest.importorskip("memctl.integrations.huggingface")

import transformers

from memctl.integrations.huggingface import STATE_FILE, MemctlCallback


class _Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 64, seq: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 128, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


class Probe(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, cb: MemctlCallback) -> None:
        self.cb = cb
        self.steps: list[tuple[int, int]] = []  # (trainer global_step, controller step) at each step end
        self.first: int | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.first is None and self.cb.controller is not None:
            self.first = self.cb.controller.step_count

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        assert self.cb.controller is not None and self.cb.controller.attached
        self.steps.append((state.global_step, self.cb.controller.step_count))


def _trainer(out: Path, callbacks: list[Any], max_steps: int, model: Any = None) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-3, logging_steps=1, save_strategy="steps", save_steps=2, report_to="none",
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    return transformers.Trainer(model=model if model is not None else _model(), args=args,
                                train_dataset=_Data(), callbacks=callbacks)


def test_train_attaches_steps_per_optimizer_step_logs_and_detaches(tmp_path: Path) -> None:
    cb = MemctlCallback(bits=2.0, monitor_interval_s=0)
    probe = Probe(cb)
    trainer = _trainer(tmp_path, [cb, probe], max_steps=4)
    model = trainer.model
    trainer.train()
    # Two micro-batches per optimizer step; the controller steps with the optimizer.
    assert probe.steps == [(1, 1), (2, 2), (3, 3), (4, 4)]
    logged = [e for e in trainer.state.log_history if "memctl/ratio" in e]
    assert [e["step"] for e in logged if "loss" in e] == [1, 2, 3, 4]
    last = logged[-1]
    assert last["memctl/ratio"] > 3 and 0 < last["memctl/avg_bits"] <= 8
    assert last["memctl/activation_packed_bytes"] < last["memctl/activation_raw_bytes"]
    assert "memctl/budget_bytes" not in last  # no budget: left out, never NaN
    for saved in ("checkpoint-2", "checkpoint-4"):
        assert (tmp_path / saved / STATE_FILE).is_file()
    assert cb.controller is None and not model._forward_pre_hooks


def test_resume_restores_the_controller_state(tmp_path: Path) -> None:
    cb = MemctlCallback(budget="256MiB", monitor_interval_s=0)
    _trainer(tmp_path, [cb], max_steps=2).train()
    state = torch.load(tmp_path / "checkpoint-2" / STATE_FILE, weights_only=True)
    assert state["step"] == 2 and state["budget"] == 256 * 2**20

    cb2 = MemctlCallback(monitor_interval_s=0)  # no budget here: the checkpoint's comes back
    probe = Probe(cb2)
    trainer = _trainer(tmp_path, [cb2, probe], max_steps=4)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert probe.first == 2 and probe.steps[-1] == (4, 4)
    logged = [e for e in trainer.state.log_history if "memctl/budget_bytes" in e]
    assert logged and logged[-1]["memctl/budget_bytes"] == 256 * 2**20
