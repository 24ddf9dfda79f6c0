"""Code the packaged DAG imports from inside its archive."""
