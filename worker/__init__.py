"""The worker service: runs task attempts from ``deferral:queue:<queue>``."""
