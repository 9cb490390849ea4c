"""Parameter recognition across steps (NOTE [ Parameter scan ] in ``memctl/controller/packing.py``)."""

from __future__ import annotations

import torch
from torch import nn

from memctl.controller.config import ControllerConfig
from memctl.controller.hooks import ModuleTracker
from memctl.controller.packing import Packer, Saved
from memctl.controller.versions import SavedRef


def _packer() -> Packer:
    tracker = ModuleTracker()
    tracker.model_depth = 1
    return Packer(ControllerConfig(min_numel=0), tracker, lambda layer: (2.0, None), lambda layer, exc: None,
                  queue=False)


def test_a_parameter_whose_data_moved_is_recognised_after_a_quiet_boundary() -> None:
    model = nn.Linear(64, 64)
    packer = _packer()
    packer.set_parameters(model)
    assert isinstance(packer.pack(model.weight), SavedRef)
    model.weight.data = torch.randn(64, 64)  # new storage, as model.to(...) or a loaded state gives
    fresh = packer.pack(model.weight)
    # not known by its storage yet, but held by its values, as a frozen weight's cast is
    # (NOTE [ Copies of parameters without a node ] in copies.py)
    assert isinstance(fresh, SavedRef)
    packer._copies.set([])  # without that, it would be compressed
    assert isinstance(packer.pack(model.weight), Saved)
    packer.finish_step()
    packer.refresh_parameters(model, full=False)
    assert isinstance(packer.pack(model.weight), SavedRef)
    assert isinstance(packer.pack(model.weight.t()), SavedRef)  # a view of it too


def test_a_full_refresh_finds_a_newly_registered_parameter() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    packer = _packer()
    packer.set_parameters(model)
    model.append(nn.Linear(8, 8))
    packer.refresh_parameters(model, full=False)  # known parameters did not move: no walk
    assert isinstance(packer.pack(model[1].weight), Saved)
    packer.refresh_parameters(model, full=True)  # an allocation step walks the model
    assert isinstance(packer.pack(model[1].weight), SavedRef)
