from cokit.cli import main

raise SystemExit(main())
