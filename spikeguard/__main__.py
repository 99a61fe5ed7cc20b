"""`python -m spikeguard` is the `spikeguard` command."""

from spikeguard.cli import main

raise SystemExit(main())
