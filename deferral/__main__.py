"""``python -m deferral``: the ``deferral`` command. A program entry point, not library code: the
command lives in the top-level package ``deferral_cli`` (it consumes every layer), which
``deferral`` itself never imports."""

from deferral_cli import main

main()
