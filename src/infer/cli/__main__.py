"""``python -m infer.cli``: the `infer` command (as ``python -m infer``)."""

from infer.cli import main

raise SystemExit(main())
