"""`python -m ds4` runs the ds4 CLI."""

from ds4.cli import main

raise SystemExit(main())
