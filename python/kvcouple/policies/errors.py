"""The errors a policy spec raises: all :class:`kvcouple.errors.InvalidInputError`
(``ValueError``), so the command line reports them as bad input."""

from __future__ import annotations

from kvcouple.errors import InvalidInputError


class PolicyError(InvalidInputError):
    """A policy spec that cannot be used: unknown policy, unknown or bad parameter."""


class UnknownPolicyError(PolicyError):
    """No policy of this name is registered."""


class PolicyParameterError(PolicyError):
    """A parameter the policy does not take, or a value it cannot use."""
