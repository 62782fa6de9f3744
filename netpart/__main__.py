from netpart.cli import main

raise SystemExit(main())
