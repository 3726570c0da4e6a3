"""Synthetic verifiable tasks, generated locally so that the quickstart and tests need no download."""
