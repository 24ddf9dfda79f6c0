"""The triggerer service: runs many triggers in one event loop."""
