"""Why a job cannot be routed to a model (codes of the contract; potocolom.web maps them to 400)."""
from __future__ import annotations

from potocolom.protocol.errors import DomainError


class UnknownModel(DomainError):
    """No model with that model_id is registered."""

    code = "unknown_model"


class InvalidParams(DomainError):
    """The params do not match the model's params_schema."""

    code = "invalid_params"


class NoMatchingModel(DomainError):
    """No registered model fits the tier, capabilities and params asked for."""

    code = "no_matching_model"
