"""Python RNG state as JSON-friendly lists (for checkpoint metadata) and back."""

from __future__ import annotations


def rng_state_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_state_from_json(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
