"""The model and optimizer state a background save writes, built cheaply after the first save.

DCP's `get_state_dict` checks its options and finds every parameter's fully-qualified name at each call (~3 ms
for the tiny model: most of what a background save otherwise costs the loop). `SaveStateDict` builds the same
flat dicts from `model.state_dict()` and `optimizer.state` with the names it learned once. The first save uses
`get_state_dict` and compares: only when the cheap build gives the same entries (the same keys, the same tensors,
equal values) are later saves built that way; otherwise, and for any state the cheap build does not know
(FSDP's or tensor parallel's DTensors, nested optimizer state, a parameter it has no name for, model keys that
changed), `get_state_dict` serves.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, _get_fqns, get_state_dict

logger = logging.getLogger(__name__)


class SaveStateDict:
    """`get_state_dict(model, optimizer, options=...)` for a run's saves (flattened optimizer state)."""

    def __init__(self, options: StateDictOptions):
        self.options = options
        self.usable: bool | None = None  # None until the first save compared the two builds
        self._model_names: dict[str, str] = {}  # model.state_dict() key -> get_state_dict's name
        self._param_names: dict[int, str] = {}  # id(parameter) -> its name
        # Whether every tensor of the model's state is a parameter: then only an optimizer step changes it
        # (a buffer may change in the forward pass, e.g. batch norm's running statistics).
        self.parameters_only = False

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.usable:
            built = self._build(model, optimizer)
            if built is not None:
                return built
        expected = get_state_dict(model, optimizer, options=self.options)
        if self.usable is None:
            self.usable = self._learn(model) and _same(self._build(model, optimizer), expected)
            logger.info("checkpoint state dicts are built %s", "from the model's and optimizer's own state after "
                        "this save" if self.usable else "by DCP's get_state_dict (this model's state needs it)")
        return expected

    def build(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              settings: list[list[tuple[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The cheap build, once the first save showed it usable, with the parameter groups' `settings` taken
        earlier (`optimizer_settings`): what the save thread calls.

        Raises:
            ValueError: the state no longer has the layout the first save learned.
        """
        built = self._build(model, optimizer, settings) if self.usable else None
        if built is None:
            raise ValueError("the model's or optimizer's state changed its layout since the run's first background "
                             "save (new parameters, new optimizer state); save with --async-save off for this run")
        return built

    def _learn(self, model: nn.Module) -> bool:
        names = {}
        for key in model.state_dict():
            fqns = _get_fqns(model, key)
            if len(fqns) != 1:
                return False
            names[key] = next(iter(fqns))
        self._model_names = names
        params = {}
        for key, parameter in model.named_parameters():
            fqns = _get_fqns(model, key)
            if len(fqns) != 1:
                return False
            params[id(parameter)] = next(iter(fqns))
        self._param_names = params
        parameter_names = {key for key, _ in model.named_parameters(remove_duplicate=False)}
        self.parameters_only = self._model_names.keys() <= parameter_names
        return True

    def _build(self, model: nn.Module, optimizer: torch.optim.Optimizer,
               settings: list[list[tuple[str, Any]]] | None = None) -> tuple[dict, dict] | None:
        """The flat model and optimizer state, or None where this build does not know the state. `settings`:
        each parameter group's settings (default: as they are now)."""
        raw = model.state_dict()
        if raw.keys() != self._model_names.keys():
            return None
        model_state = {self._model_names[key]: value for key, value in raw.items()}
        if any(type(value) is not torch.Tensor for value in model_state.values()):
            return None  # DTensors and other subclasses: get_state_dict's business
        state: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        if settings is None:
            settings = optimizer_settings(optimizer)
        if len(settings) != len(optimizer.param_groups):
            return None
        for group, group_settings in zip(optimizer.param_groups, settings):
            for parameter in group["params"]:
                name = self._param_names.get(id(parameter))
                if name is None:
                    return None
                for key, value in optimizer.state.get(parameter, {}).items():
                    if isinstance(value, dict):
                        return None  # nested optimizer state (e.g. Shampoo): flattened by get_state_dict
                    state[f"state.{name}.{key}"] = value
                for key, value in group_settings:
                    groups[f"param_groups.{name}.{key}"] = value
        return model_state, {**state, **groups}


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[list[tuple[str, Any]]]:
    """Each parameter group's settings but its parameters (learning rate, betas, ...), as they are now."""
    return [[(key, value) for key, value in group.items() if key != "params"] for group in optimizer.param_groups]


def _same(built: tuple[dict, dict] | None, expected: tuple[dict, dict]) -> bool:
    """Whether two (model, optimizer) state pairs hold the same keys, the same tensors and equal values."""
    if built is None:
        return False
    for mine, theirs in zip(built, expected):
        if mine.keys() != theirs.keys():
            return False
        for key, value in theirs.items():
            other = mine[key]
            if isinstance(value, torch.Tensor):
                if not (type(other) is type(value) and other.data_ptr() == value.data_ptr()
                        and other.shape == value.shape and other.stride() == value.stride()
                        and other.dtype == value.dtype):
                    return False
            elif isinstance(other, torch.Tensor) or other != value:
                return False
    return True
