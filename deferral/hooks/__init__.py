"""Hooks: small clients for external systems, built on connections (``deferral.hooks.base``)."""
