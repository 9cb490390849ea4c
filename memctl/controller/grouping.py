"""Several layers measured in one replay, where each one's noise stays in its own parameters.

NOTE [ Several layers per replay ]
A layer measurement (NOTE [ Calibration ]) replays the step with one layer compressed:
one forward and backward per (layer, width). A network of 60 layers at four widths is 240
replays, so in a short run most layers are never measured and keep the fitted factor of
NOTE [ Unmeasured layers ] (and no 1 bit). Measuring two layers in one replay is sound
only when their errors can be told apart in the gradient, and for many layers they can:
a linear or convolution layer's saved input is read by the backward only to form that
layer's own weight gradient, so the error of compressing it lands in that one
parameter and nowhere else; a ReLU's output, which the next convolution reads through
the same record (NOTE [ De-duplication ]), lands in that convolution's weight. A
BatchNorm or GELU input is different: its error enters the input gradient and reaches
every parameter below.

So the calibration does not assume, it looks. When a layer is measured alone, the
squared error of the gradient is split by parameter tensor; the fewest tensors holding
``_COVER`` (99.5%) of it, if there are at most ``_MAX_FOOTPRINT`` of them, are the
layer's *footprint* (:func:`footprint`); a layer whose error spreads wider has none.
From then on, layers with footprints that do not overlap are measured together, one
replay per group and width (:func:`plan`), and each one's value is the squared error
inside its own footprint. The replay checks the premise again: the error outside every
member's footprint must stay under ``1 − _COVER`` of the total, else the group's
values are discarded and its members lose their footprints (measured alone again).

Before its first measurement a layer has a footprint only by its kind
(:func:`prior_footprints`): a ``Linear`` or ``ConvNd`` module (or a module named
``Conv1D``, GPT-2's) that holds records of its own. Its only compressed saved tensor is
its input (the weight is a parameter, never compressed), and the backward reads that
input only for the weight's gradient, so the error stays in the module's own
parameters. A module whose input was saved first by another layer (a ReLU's output, read
through the same record, NOTE [ De-duplication ]) holds no record and is no layer, so it
is never a member; the owner's error in its weight is outside every member's footprint
and the check above catches it. A prior that fails the check is dropped like a measured
one, and the layer is measured alone. On transformers, where the linear layers own
their inputs, the first pass at the first width then also costs one replay per group;
on ResNet-style nets, where the ReLUs and BatchNorms own the records, it does not.

Grouping is off unless ``calibration_groups=True``: the check above sees errors that leave
every member's footprint, not an error that lands in another member's footprint, nor a
change in how the members are encoded when they are compressed together. Layers of a
batch-norm chain (NOTE [ Batch-norm outputs recomputed from the input ]) are encoded as
one record at their summed bits when both are compressed, so a grouped replay of a
batch norm and the ReLU after it measured the batch norm at a tenth of what compressing
it alone adds (``tests/controller/test_variance.py`` on the test CNN).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["footprint", "inside", "plan", "prior_footprints", "shares", "sound"]

# Modules whose only compressed saved tensor is an input read for the weight's gradient alone.
_WEIGHT_ONLY = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
_WEIGHT_ONLY_NAMES = frozenset({"Conv1D"})

_COVER = 0.995
_MAX_FOOTPRINT = 3


def shares(delta: torch.Tensor, sizes: list[int]) -> list[float]:
    """The squared norm of ``delta`` (a flat gradient difference) within each parameter."""
    if sum(sizes) != delta.numel():
        return []
    return [float(x.square().sum()) for x in torch.split(delta, sizes)]


def prior_footprints(model: torch.nn.Module, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """The footprints of ``names`` by their kind: a linear or convolution module's own
    parameters (indices among the parameters that require grad); other names get none."""
    index = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    modules = dict(model.named_modules())
    out: dict[str, tuple[int, ...]] = {}
    for name in names:
        module = modules.get(name)
        if module is None or not (isinstance(module, _WEIGHT_ONLY)
                                  or type(module).__name__ in _WEIGHT_ONLY_NAMES):
            continue
        own = tuple(sorted(index[id(p)] for p in module.parameters(recurse=False) if id(p) in index))
        if own:
            out[name] = own
    return out


def footprint(parts: list[float]) -> tuple[int, ...]:
    """The fewest parameters holding ``_COVER`` of the squared error (empty: spread wider, or none)."""
    total = sum(parts)
    if not parts or not total > 0:
        return ()
    order = sorted(range(len(parts)), key=lambda i: -parts[i])
    kept: list[int] = []
    covered = 0.0
    for i in order:
        if covered >= _COVER * total:
            break
        kept.append(i)
        covered += parts[i]
        if len(kept) > _MAX_FOOTPRINT:
            return ()
    return tuple(sorted(kept))


def inside(parts: list[float], where: Iterable[int]) -> float:
    """The squared error within the parameters ``where``."""
    return sum(parts[i] for i in where if i < len(parts))


def sound(parts: list[float], footprints: Iterable[tuple[int, ...]]) -> bool:
    """Whether the error outside the members' footprints is within ``1 − _COVER`` of the total."""
    total = sum(parts)
    covered = set().union(*footprints)
    return total <= 0 or total - inside(parts, covered) <= (1.0 - _COVER) * total


def plan(pairs: Iterable[tuple[str, int]], footprints: Mapping[str, tuple[int, ...]],
         limit: int) -> list[list[tuple[str, int]]]:
    """The first ``limit`` replays for ``pairs``: each pair alone, except that a pair whose
    layer has a footprint joins the first group of its width whose members' footprints it
    does not overlap."""
    jobs: list[list[tuple[str, int]]] = []
    used: list[set[int]] = []
    for name, bits in pairs:
        mine = footprints.get(name, ())
        if mine:
            for job, taken in zip(jobs, used, strict=True):
                if job[0][1] == bits and taken and not taken & set(mine) \
                        and all(n != name for n, _ in job):
                    job.append((name, bits))
                    taken.update(mine)
                    break
            else:
                jobs.append([(name, bits)])
                used.append(set(mine))
            continue
        jobs.append([(name, bits)])
        used.append(set())
    return jobs[:max(limit, 0)]
