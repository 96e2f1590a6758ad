"""``python -m sidecar.cli``: the ``refitd`` command."""

from sidecar.cli.main import main

raise SystemExit(main())
