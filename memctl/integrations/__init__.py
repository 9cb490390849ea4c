"""Callbacks that attach a :class:`memctl.Controller` to a trainer.

- :mod:`memctl.integrations.lightning`: ``MemctlCallback`` for ``lightning.Trainer``
  (extra ``memctl[lightning]``).
- :mod:`memctl.integrations.huggingface`: ``MemctlCallback`` for ``transformers.Trainer``
  (extra ``memctl[huggingface]``).
- :mod:`memctl.integrations.tensorboard`: ``TensorBoardLogger`` for plain training loops
  (extra ``memctl[tensorboard]``).

Importing this package imports none of those libraries; each submodule imports its own.
"""

from __future__ import annotations

__all__: list[str] = []
