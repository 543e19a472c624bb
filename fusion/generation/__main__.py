"""``python -m fusion.generation --help``."""

from fusion.generation.cli import main

raise SystemExit(main())
